//! Long contexts in bounded memory: with a fixed prefill chunk, what a step holds besides
//! the KV — the attention's scratch and the step's activations — is the same at 1K and at
//! 16K tokens of context, under `full` and under `headwise`, while the KV itself grows with
//! the context; and the budget the policies plan with covers what the steps held.
//!
//! The kernel's scratch depends on the thread count (one workspace per thread), so the
//! runs use a two-thread pool, as on the CI machine.
use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device};
use kvpolicy::models::engine::generate::{chunk_len, kv_shape};
use kvpolicy::models::{generate, load, resolve, GenerateConfig, ModelSpec};
use kvpolicy::{build_policy, HeadGroup, KvStats, PolicyOptions};

const CHUNK: usize = 256;

fn config(dir: &Path) -> Result<std::path::PathBuf> {
    let path = dir.join("config.json");
    let cfg = serde_json::json!({
        "model_type": "llama",
        "hidden_size": 192,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 32,
        "vocab_size": 256,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 20000,
        "rope_theta": 100000.0,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2
    });
    std::fs::write(&path, serde_json::to_string(&cfg)?)?;
    Ok(path)
}

#[test]
fn step_scratch_does_not_grow_with_the_context() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let files = resolve(&ModelSpec::Random {
        config: config(dir.path())?,
        seed: 3,
    })?;
    let model = load(&files, &Device::Cpu, DType::F32, None)?.model;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build()?;
    for (name, group) in [("full", HeadGroup::Auto), ("headwise", HeadGroup::Fixed(1))] {
        let mut seen: Vec<(usize, KvStats, u64)> = Vec::new();
        for context in [1024usize, 16384] {
            let prompt: Vec<u32> = (0..context).map(|i| (i * 31 % 250) as u32 + 3).collect();
            let cfg = GenerateConfig {
                prefill_chunk: CHUNK,
                max_new_tokens: 2,
                stop_at_eos: false,
                ..GenerateConfig::default()
            };
            let mut p = build_policy(&with_group(name, group), &PolicyOptions::default())?;
            pool.install(|| generate(model.as_ref(), p.as_mut(), &prompt, &cfg, &mut |_| Ok(())))?;
            let heads = if name == "full" { 3 } else { 1 };
            let planned = pool.install(|| {
                kv_shape(model.info(), 1, context + 2, chunk_len(CHUNK, context))
                    .step_scratch_bytes(heads, context + 2, &Device::Cpu)
            });
            seen.push((context, p.stats(), planned));
        }
        let (short, long) = (&seen[0].1, &seen[1].1);
        println!(
            "{name}: attention scratch {} / {} B, step scratch {} / {} B, device KV peak {} / {} B at 1K / 16K",
            short.attn_scratch_peak_bytes,
            long.attn_scratch_peak_bytes,
            short.device_scratch_peak_bytes,
            long.device_scratch_peak_bytes,
            short.device_kv_peak_bytes,
            long.device_kv_peak_bytes
        );
        assert!(short.attn_scratch_peak_bytes > 0);
        assert_eq!(
            short.attn_scratch_peak_bytes, long.attn_scratch_peak_bytes,
            "{name}"
        );
        assert_eq!(
            short.device_scratch_peak_bytes, long.device_scratch_peak_bytes,
            "{name}"
        );
        // The activations of a chunk come on top of the attention's scratch.
        assert!(short.device_scratch_peak_bytes > short.attn_scratch_peak_bytes);
        // The KV grows with the context (16× the tokens).
        assert!(
            long.device_kv_peak_bytes >= 8 * short.device_kv_peak_bytes,
            "{name}"
        );
        // What the policies plan budgets with covers what the steps held.
        for (context, st, planned) in &seen {
            assert!(
                st.device_scratch_peak_bytes <= *planned,
                "{name} at {context}: held {} > planned {planned}",
                st.device_scratch_peak_bytes
            );
        }
    }
    Ok(())
}

/// `policy` with head group `group` when it takes one (`headwise:group=N`), else `policy`.
fn with_group(policy: &str, group: HeadGroup) -> String {
    if policy == "headwise" {
        format!("headwise:group={group}")
    } else {
        policy.to_string()
    }
}
