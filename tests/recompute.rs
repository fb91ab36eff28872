//! `recompute` (KVPR) against `full`: identical logits for forced and scheduled splits,
//! exact per-step traffic on a multi-head fixture, `l = 0` on grouped-query models, and
//! clear errors for options that cannot work.
mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::models::load::source::ModelFiles;
use kvpolicy::models::{generate, load, prefill, GenerateConfig, Generation};
use kvpolicy::{build_policy, PolicyOptions, Profile};

/// Options with `recompute`'s forced split.
#[derive(Clone, Debug)]
struct Setup {
    split: Option<usize>,
    opts: PolicyOptions,
}

impl Setup {
    /// `policy` built with these options (and the split, for `recompute`).
    fn build(&self, policy: &str) -> Result<Box<dyn kvpolicy::KvPolicy>, kvpolicy::KvError> {
        let spec = match (policy, self.split) {
            ("recompute", Some(n)) => format!("recompute:split={n}"),
            _ => policy.to_string(),
        };
        build_policy(&spec, &self.opts)
    }
}

fn opts(split: Option<usize>, profile: Option<Profile>, grow: usize) -> Setup {
    Setup {
        split,
        opts: PolicyOptions {
            profile,
            grow_tokens: grow,
            ..PolicyOptions::default()
        },
    }
}

/// A profile where regenerating a token takes `ratio` × the time its K/V take to cross the
/// link, for a layer of `kv_bytes` K+V per token.
fn synthetic(kv_bytes: f64, ratio: f64) -> Profile {
    let bw = 1e9;
    Profile {
        h2d_bytes_per_s: bw,
        recompute_tokens_per_s: bw / kv_bytes / ratio,
        device: None,
        shape: None,
    }
}

fn logits(g: Generation) -> Result<Tensor> {
    g.logits.ok_or_else(|| anyhow::anyhow!("no logits"))
}

#[test]
fn recompute_logits_equal_full_for_every_split() -> Result<()> {
    for name in common::hf_fixtures() {
        let loaded = common::load_fixture(&name)?;
        let model = loaded.model.as_ref();
        let info = model.info().clone();
        let (prompt, decode) = common::fixture_ids(&name)?;
        let s = prompt.len() + decode.len();
        let kv = (2 * info.n_kv_heads * info.head_dim * 4) as f64;
        for chunk in [0, 5] {
            let mut full = build_policy("full", &PolicyOptions::default())?;
            let want = logits(common::teacher_forced(
                model,
                full.as_mut(),
                &prompt,
                &decode,
                chunk,
            )?)?;
            let mut cases: Vec<(String, Setup)> = [0, 1, s / 2, s]
                .iter()
                .map(|&l| (format!("split {l}"), opts(Some(l), None, 4)))
                .collect();
            cases.push((
                "scheduled, synthetic".into(),
                opts(None, Some(synthetic(kv, 0.3)), 4),
            ));
            cases.push(("scheduled, measured".into(), opts(None, None, 256)));
            for (what, o) in cases {
                let mut p = o.build("recompute")?;
                let got = logits(common::teacher_forced(
                    model,
                    p.as_mut(),
                    &prompt,
                    &decode,
                    chunk,
                )?)?;
                let d = common::max_abs_diff(&got, &want)?;
                println!(
                    "{name} chunk {chunk} {what}: max |Δ| = {d:.2e}, split {}, recomputed {}",
                    common::metric(&p.stats(), "split"),
                    p.stats().recompute_tokens
                );
                assert!(d <= 1e-4, "{name} chunk {chunk} {what}: max |Δ| = {d}");
                let st = p.stats();
                if what.starts_with("split") && what != "split 0" {
                    assert!(st.recompute_tokens > 0, "{name} {what}: nothing recomputed");
                    assert!(st.recompute_flops > 0);
                }
            }
        }
    }
    Ok(())
}

#[test]
fn mha_decode_step_moves_x_of_the_split_and_kv_of_the_rest() -> Result<()> {
    let name = "llama_mha";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    assert_eq!(info.n_kv_heads, info.n_heads, "the fixture must be MHA");
    let (prompt, decode) = common::fixture_ids(name)?;
    let b = 4u64; // f32
    let (hidden, nkv, d, layers) = (
        info.hidden as u64,
        info.n_kv_heads as u64,
        info.head_dim as u64,
        info.n_layers as u64,
    );
    for l in [0usize, 1, 7, 16, 40] {
        let mut p = opts(Some(l), None, 8).build("recompute")?;
        prefill(model, p.as_mut(), &prompt, 0, false)?;
        for (pos, &tok) in (prompt.len()..).zip(decode.iter()) {
            let before = p.stats();
            let ids = Tensor::new(&[tok], &Device::Cpu)?.unsqueeze(0)?;
            model.forward(&ids, pos, p.as_mut(), kvpolicy::LogitsMode::Last)?;
            let after = p.stats();
            let (s, lr) = (pos as u64, l.min(pos) as u64);
            assert_eq!(
                after.h2d_bytes - before.h2d_bytes,
                layers * (lr * hidden * b + (s - lr) * 2 * nkv * d * b),
                "split {l} at {pos}: h2d"
            );
            assert_eq!(common::metric(&after, "split"), lr);
            assert_eq!(
                after.recompute_tokens - before.recompute_tokens,
                layers * lr
            );
            // Back: the new token's K/V, and its X while inside the prefix.
            let x_back = if pos < l { hidden * b } else { 0 };
            assert_eq!(
                after.d2h_bytes - before.d2h_bytes,
                layers * (2 * nkv * d * b + x_back),
                "split {l} at {pos}: d2h"
            );
        }
    }
    Ok(())
}

#[test]
fn grouped_query_models_derive_split_zero() -> Result<()> {
    // Even with regeneration 100× faster than the transfer, X (hidden wide) is larger than
    // K+V, so the scheduler keeps l = 0 and recompute moves what layer-wise offload moves.
    for name in ["llama_gqa", "llama3_rope"] {
        let loaded = common::load_fixture(name)?;
        let model = loaded.model.as_ref();
        let info = model.info().clone();
        assert!(info.n_heads >= 2 * info.n_kv_heads);
        let (prompt, decode) = common::fixture_ids(name)?;
        let kv = (2 * info.n_kv_heads * info.head_dim * 4) as f64;
        let mut p = opts(None, Some(synthetic(kv, 0.01)), 8).build("recompute")?;
        common::teacher_forced(model, p.as_mut(), &prompt, &decode, 0)?;
        let mut layer = opts(None, None, 8).build("layer")?;
        common::teacher_forced(model, layer.as_mut(), &prompt, &decode, 0)?;
        let (r, l) = (p.stats(), layer.stats());
        assert_eq!(
            (
                common::metric(&r, "split"),
                r.recompute_tokens,
                r.recompute_flops
            ),
            (0, 0, 0),
            "{name}"
        );
        assert_eq!(r.h2d_bytes, l.h2d_bytes, "{name}");
        assert_eq!(r.host_kv_bytes, l.host_kv_bytes, "{name}: no X kept");
    }
    // The MHA fixture under the same profile recomputes.
    let loaded = common::load_fixture("llama_mha")?;
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    let (prompt, decode) = common::fixture_ids("llama_mha")?;
    let kv = (2 * info.n_kv_heads * info.head_dim * 4) as f64;
    let mut p = opts(None, Some(synthetic(kv, 0.01)), 8).build("recompute")?;
    common::teacher_forced(model, p.as_mut(), &prompt, &decode, 0)?;
    assert!(common::metric(&p.stats(), "split") > 0 && p.stats().recompute_tokens > 0);
    Ok(())
}

#[test]
fn smollm2_greedy_ids_equal_full_with_quantized_regeneration() -> Result<()> {
    let loaded = load(
        &ModelFiles::Gguf(common::default_gguf()?),
        &Device::Cpu,
        DType::F32,
        None,
    )?;
    let model = loaded.model.as_ref();
    let refs = common::llamacpp_refs()?;
    let cfg = GenerateConfig {
        max_new_tokens: 24,
        stop_at_eos: false,
        ..GenerateConfig::default()
    };
    let g = refs["greedy"]
        .as_array()
        .and_then(|a| a.first())
        .ok_or_else(|| anyhow::anyhow!("no greedy reference"))?;
    let prompt = common::ids_of(&g["prompt_ids"])?;
    let mut full = build_policy("full", &PolicyOptions::default())?;
    let want = generate(model, full.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?.generated_ids;
    let s = prompt.len() + 24;
    for split in [None, Some(1), Some(s / 2), Some(s)] {
        let mut p = opts(split, None, 256).build("recompute")?;
        let got = generate(model, p.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?.generated_ids;
        assert_eq!(got, want, "split {split:?}");
        if split.is_none() {
            // SmolLM2: 9 query heads over 3 KV heads, X is 1.5× K+V — nothing to recompute.
            assert_eq!(p.stats().recompute_tokens, 0);
        } else {
            assert!(p.stats().recompute_tokens > 0);
        }
    }
    Ok(())
}

#[test]
fn a_split_beyond_the_sequence_is_a_clear_error() -> Result<()> {
    let loaded = common::load_fixture("llama_mha")?;
    let model = loaded.model.as_ref();
    let (prompt, _) = common::fixture_ids("llama_mha")?;
    let cfg = GenerateConfig {
        max_new_tokens: 4,
        ..GenerateConfig::default()
    };
    let max = prompt.len() + 4;
    let mut p = opts(Some(max + 1), None, 8).build("recompute")?;
    let e = generate(model, p.as_mut(), &prompt, &cfg, &mut |_| Ok(()))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains(&format!("`split` {} is beyond the sequence", max + 1))
            && e.contains(&format!("0..={max}")),
        "{e}"
    );
    // Exactly the sequence is fine.
    let mut p = opts(Some(max), None, 8).build("recompute")?;
    generate(model, p.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?;
    // A profile with a non-positive rate is refused when the policy is built.
    let bad = Profile {
        h2d_bytes_per_s: 0.0,
        recompute_tokens_per_s: 1.0,
        device: None,
        shape: None,
    };
    let e = opts(None, Some(bad), 8)
        .build("recompute")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("`h2d_bytes_per_s` is 0"), "{e}");
    Ok(())
}
