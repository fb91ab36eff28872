//! Hostile model directories (issue "Hardening III"): weights, configs and tokenizers that
//! used to give silent wrong output (NaN hidden by the attention kernel, config numbers that
//! pass as f64 but break as f32, weights taken from the wrong file or cast from integers, a
//! missing LM head tied behind the config's back), panics (wrapped size arithmetic, a
//! regex engine's retry limit) or unbounded work (nested template loops, an expanding
//! normalizer, `auto` reserving for `--max-new-tokens`, ten million tiny layers) — each now a
//! one-line error naming the field, tensor or file, exit code 1, before heavy work.
mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};

/// Rewrites `dir`'s config.json with `edit`.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> Result<()> {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p)?)?;
    edit(&mut v);
    std::fs::write(p, v.to_string())?;
    Ok(())
}

/// Rewrites `dir`'s model.safetensors with `edit` over its tensors.
fn edit_weights(
    dir: &Path,
    edit: impl FnOnce(&mut HashMap<String, Tensor>) -> Result<()>,
) -> Result<()> {
    let p = dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&p, &Device::Cpu)?;
    edit(&mut t)?;
    candle_core::safetensors::save(&t, &p)?;
    Ok(())
}

/// `t` with its first element set to NaN.
fn with_nan(t: &Tensor) -> Result<Tensor> {
    let mut v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    v[0] = f32::NAN;
    Ok(Tensor::from_vec(v, t.shape(), &Device::Cpu)?.to_dtype(t.dtype())?)
}

/// Runs the example for `dir`'s architecture (`qwen` for Qwen2, `gemma` for Gemma, else
/// `llama`) on it.
fn run(dir: &Path, extra: &[&str]) -> Result<Output> {
    let cfg = std::fs::read_to_string(dir.join("config.json"))?;
    let example = match () {
        _ if cfg.contains("\"qwen2\"") => "qwen",
        _ if cfg.contains("\"gemma") => "gemma",
        _ => "llama",
    };
    Ok(std::process::Command::new(common::example_bin(example))
        .arg("--model-dir")
        .arg(dir)
        .args(["--max-new-tokens", "4"])
        .args(extra)
        .env("HF_HUB_OFFLINE", "1")
        .output()?)
}

#[test]
fn a_nan_weight_is_an_error_not_confident_tokens() -> Result<()> {
    for (fixture, tensor) in [
        ("llama_gqa", "model.layers.0.self_attn.q_proj.weight"),
        ("qwen2", "model.layers.0.self_attn.k_proj.bias"),
    ] {
        let d = common::copy_fixture(fixture)?;
        edit_weights(d.path(), |t| {
            let w = t
                .get(tensor)
                .ok_or_else(|| anyhow::anyhow!("no {tensor}"))?;
            let nan = with_nan(w)?;
            t.insert(tensor.to_string(), nan);
            Ok(())
        })?;
        // Named at load, with its tensor, before any policy runs.
        let o = run(d.path(), &["--prompt-ids", "1,2,3", "--policy", "headwise"])?;
        common::cli::one_line_error(&o, false, &["holds a NaN or an infinity", tensor])
            .map_err(|e| e.context(format!("{fixture} {tensor}")))?;
    }
    Ok(())
}

#[test]
fn attention_keeps_a_nan_that_fills_a_score_row() -> Result<()> {
    // A NaN born at run time (a quantized weight's scale, an overflow) that fills a head's
    // queries: every score of the row is NaN. The CPU kernel's running maximum skipped NaN
    // and zeroed the row as if it saw no key; now the NaN reaches the output (and the
    // non-finite check on the logits), in decode and in a prefill chunk, as in the eager
    // reference.
    let dev = Device::Cpu;
    let spec = kvpolicy::AttnSpec::new(4, 2, 16);
    for (t, s) in [(1, 40), (8, 8), (1, 3000)] {
        let q = Tensor::full(f32::NAN, (1, 4, t, 16), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (1, 2, s, 16), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (1, 2, s, 16), &dev)?;
        let out = kvpolicy::attend(
            kvpolicy::AttnInputs {
                q: &q,
                k: &k,
                v: &v,
                q_pos: s - t,
                k_pos: 0,
            },
            &spec,
        )?;
        let nan = out
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|x| x.is_nan());
        ensure!(nan, "t {t}, s {s}: a NaN query row gave finite output");
    }
    Ok(())
}

#[test]
fn config_numbers_are_checked_as_the_f32_they_become() -> Result<()> {
    use serde_json::json;
    let cases: [(&str, &str, serde_json::Value, &str); 6] = [
        ("llama_gqa", "rope_theta", json!(1e39), "rope_theta"),
        ("llama_gqa", "rms_norm_eps", json!(1e39), "rms_norm_eps"),
        (
            "llama_gqa",
            "rope_scaling",
            json!({"rope_type": "linear", "factor": 0.0}),
            "rope_scaling.factor",
        ),
        (
            "llama_gqa",
            "rope_scaling",
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            "rope_scaling.high_freq_factor",
        ),
        (
            "gemma2",
            "query_pre_attn_scalar",
            json!(1e-50),
            "query_pre_attn_scalar",
        ),
        (
            "gemma2",
            "attn_logit_softcapping",
            json!(1e300),
            "attn_logit_softcapping",
        ),
    ];
    for (fixture, field, value, named) in cases {
        let d = common::copy_fixture(fixture)?;
        edit_config(d.path(), |c| c[field] = value.clone())?;
        let o = run(d.path(), &["--prompt-ids", "1,2,3"])?;
        common::cli::one_line_error(&o, false, &[&format!("`{named}`")])
            .map_err(|e| e.context(format!("{fixture} {field} = {value}")))?;
    }
    Ok(())
}

#[test]
fn weights_that_are_not_what_they_seem_are_refused() -> Result<()> {
    // The same tensor in a second file: candle would take the one that sorts last.
    let d = common::copy_fixture("llama_gqa")?;
    let name = "model.norm.weight";
    let t = candle_core::safetensors::load(d.path().join("model.safetensors"), &Device::Cpu)?;
    let other: HashMap<String, Tensor> = [(name.to_string(), (t[name].clone() * 2.0)?)].into();
    candle_core::safetensors::save(&other, d.path().join("zz-extra.safetensors"))?;
    let o = run(d.path(), &["--prompt-ids", "1,2,3"])?;
    common::cli::one_line_error(
        &o,
        false,
        &["zz-extra.safetensors", name, "model.safetensors"],
    )?;

    // A parameter stored as integers.
    let d = common::copy_fixture("llama_gqa")?;
    let name = "model.layers.0.mlp.up_proj.weight";
    edit_weights(d.path(), |t| {
        let w = t[name].to_dtype(DType::I64)?;
        t.insert(name.to_string(), w);
        Ok(())
    })?;
    let o = run(d.path(), &["--prompt-ids", "1,2,3"])?;
    common::cli::one_line_error(&o, false, &[name, "I64"])?;

    // Untied, without an LM head.
    let d = common::copy_fixture("llama_gqa")?;
    edit_weights(d.path(), |t| {
        t.remove("lm_head.weight");
        Ok(())
    })?;
    let o = run(d.path(), &["--prompt-ids", "1,2,3"])?;
    common::cli::one_line_error(&o, false, &["`tie_word_embeddings`", "lm_head.weight"])?;
    Ok(())
}

/// A config for random weights in a new directory.
fn random_config(v: serde_json::Value) -> Result<(tempfile::TempDir, PathBuf)> {
    let d = tempfile::tempdir()?;
    let p = d.path().join("config.json");
    std::fs::write(&p, v.to_string())?;
    Ok((d, p))
}

#[test]
fn sizes_that_overflow_or_exceed_memory_are_refused_before_allocating() -> Result<()> {
    use serde_json::json;
    let base = json!({"model_type": "llama", "hidden_size": 8, "intermediate_size": 8,
        "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
        "vocab_size": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-5});
    let with = |k: &str, v: serde_json::Value| {
        let mut c = base.clone();
        c[k] = v;
        c
    };
    for (cfg, needle) in [
        // `2 * vocab` wrapped around to 0 and passed the memory check.
        (
            with("vocab_size", json!(1u64 << 63)),
            "need more than 2^64 bytes",
        ),
        (
            {
                // heads × head_dim = 2^63: `2 * q` wrapped around to 0.
                let mut c = with("num_attention_heads", json!(1u64 << 32));
                c["num_key_value_heads"] = json!(1);
                c["head_dim"] = json!(1u64 << 31);
                c
            },
            "need more than 2^64 bytes",
        ),
        // Ten million one-wide layers: tiny weights, gigabytes of structures.
        (
            json!({"model_type": "llama", "hidden_size": 2, "intermediate_size": 1,
                "num_attention_heads": 1, "num_hidden_layers": 10_000_000, "head_dim": 2,
                "vocab_size": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}),
            "available",
        ),
    ] {
        let (_d, p) = random_config(cfg.clone())?;
        // Under a 4 GiB address-space limit, on any machine: ten million layers' values
        // (880 MB) fit it, their structures (~7.5 GB) do not.
        let o = std::process::Command::new("sh")
            .arg("-c")
            .arg("ulimit -v 4194304 && exec \"$@\"")
            .arg("sh")
            .arg(common::example_bin("llama"))
            .args(["--random-weights", "--config"])
            .arg(&p)
            .args(["--prompt-ids", "1"])
            .output()?;
        common::cli::one_line_error(&o, false, &[needle])
            .map_err(|e| e.context(cfg.to_string()))?;
    }
    // A random prompt longer than memory can hold as ids, on a model with 2^40 positions.
    let (_d, p) = random_config(with("max_position_embeddings", json!(1u64 << 40)))?;
    let o = common::cli::llama(&[
        "--random-weights",
        "--config",
        &p.to_string_lossy(),
        "--random-prompt",
        "1000000000000",
    ])?;
    common::cli::one_line_error(&o, false, &["--random-prompt", "for its ids alone"])
}

#[test]
fn auto_grows_its_resident_units_instead_of_reserving_the_run() -> Result<()> {
    use kvpolicy::models::engine::generate::kv_shape;
    // A run declared 10^9 tokens long: `auto` without a budget must hold what `full` holds
    // after the same steps, not 10^9 tokens' worth.
    let loaded = common::load_fixture("llama_gqa")?;
    let model = loaded.model.as_ref();
    let (prompt, decode) = common::fixture_ids("llama_gqa")?;
    let mut peaks = Vec::new();
    for policy in ["full", "auto"] {
        let mut p = kvpolicy::build_policy(policy, &kvpolicy::PolicyOptions::default())?;
        p.prepare(&kv_shape(model.info(), 1, 1_000_000_000, prompt.len()))?;
        kvpolicy::models::prefill(model, p.as_mut(), &prompt, 0, false)?;
        for (i, &id) in decode.iter().enumerate() {
            let ids = Tensor::new(&[id], &Device::Cpu)?.unsqueeze(0)?;
            model.forward(
                &ids,
                prompt.len() + i,
                p.as_mut(),
                kvpolicy::LogitsMode::Last,
            )?;
        }
        peaks.push(p.stats().device_kv_peak_bytes);
    }
    ensure!(
        peaks[1] == peaks[0],
        "auto {} vs full {} bytes",
        peaks[1],
        peaks[0]
    );
    ensure!(peaks[0] < 1 << 20, "{peaks:?}");
    Ok(())
}
