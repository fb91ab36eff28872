//! A test-scale soak: 2,000 decode steps under each policy on a small random-weight model,
//! with the memory stats flat — the host tier grows only in its chunks as tokens arrive, the
//! device tier stays at the buffers the current capacity needs (for `hybrid`: its pools,
//! grown by doubling, and one prefetched unit).
mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::core::round_up;
use kvpolicy::models::{load, prefill, resolve, ModelSpec};
use kvpolicy::{build_policy, HeadGroup, LogitsMode, PolicyOptions};

const STEPS: usize = 2000;
const GROW: usize = 64;

#[test]
fn two_thousand_steps_with_flat_memory() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 64, "max_position_embeddings": 4096}"#,
    )?;
    let files = resolve(&ModelSpec::Random {
        config: cfg,
        seed: 7,
    })?;
    let model = load(&files, &Device::Cpu, DType::F32, None)?.model;
    let info = model.info().clone();
    let (layers, nkv, d, hidden) = (info.n_layers, info.n_kv_heads, info.head_dim, info.hidden);
    let kv = |heads: usize, tokens: usize| (2 * heads * tokens * d * 4) as u64;
    let prompt: Vec<u32> = (0..16).map(|i| i * 3 % 64).collect();
    let split = 100;
    for (policy, group, forced) in [
        ("full", HeadGroup::Auto, None),
        ("layer", HeadGroup::Auto, None),
        ("headwise", HeadGroup::Fixed(1), None),
        ("recompute", HeadGroup::Auto, Some(split)),
    ] {
        let opts = PolicyOptions {
            grow_tokens: GROW,
            ..PolicyOptions::default()
        };
        let spec = match forced {
            Some(n) => format!("{policy}:split={n}"),
            None => common::spec(policy, group),
        };
        let mut p = build_policy(&spec, &opts)?;
        prefill(model.as_ref(), p.as_mut(), &prompt, 0, false)?;
        for i in 0..STEPS {
            let pos = prompt.len() + i;
            let ids = Tensor::new(&[(i % 64) as u32], &Device::Cpu)?.unsqueeze(0)?;
            model.forward(&ids, pos, p.as_mut(), LogitsMode::Last)?;
            let s = p.stats();
            let tokens = pos + 1;
            assert_eq!(s.kv_tokens, tokens as u64, "{policy}");
            let host_kv = layers as u64 * kv(nkv, round_up(tokens, 8 * GROW));
            let (device, host) = match policy {
                "full" => (layers as u64 * kv(nkv, round_up(tokens, GROW)), 0),
                "layer" => (2 * kv(nkv, round_up(tokens, GROW)), host_kv),
                "headwise" => (2 * kv(1, round_up(tokens, GROW)), host_kv),
                _ => {
                    // X is kept for the first `split` tokens; the two device sets hold K/V and
                    // X for this step's split (min(split, history)).
                    let xs = |cap: usize| (cap * hidden * 4) as u64;
                    (
                        2 * (kv(nkv, round_up(tokens, GROW)) + xs(round_up(split.min(pos), GROW))),
                        host_kv + layers as u64 * xs(round_up(split.min(tokens), 8 * GROW)),
                    )
                }
            };
            assert_eq!(
                s.device_kv_bytes, device,
                "{policy} at {tokens} tokens: device"
            );
            assert_eq!(s.host_kv_bytes, host, "{policy} at {tokens} tokens: host");
            assert!(
                s.device_kv_peak_bytes <= 2 * device,
                "{policy}: peak {}",
                s.device_kv_peak_bytes
            );
        }
    }
    hybrid_steps_with_flat_memory(model.as_ref(), &prompt)
}

/// `hybrid` at a 1:1 ratio: the pools grow by doubling their slots as blocks are needed,
/// and between steps the device holds the activation pool plus the next step's layer-0
/// K/V rows (prefetched), nothing else.
fn hybrid_steps_with_flat_memory(model: &dyn kvpolicy::CausalLm, prompt: &[u32]) -> Result<()> {
    const BLOCK: usize = 16;
    let info = model.info().clone();
    let (layers, nkv, d, hidden) = (info.n_layers, info.n_kv_heads, info.head_dim, info.hidden);
    let mut p = build_policy(
        &format!("hybrid:block_size={BLOCK},kv_act_ratio=0.5"),
        &PolicyOptions::default(),
    )?;
    prefill(model, p.as_mut(), prompt, 0, false)?;
    // Pool slots after doubling from 4 until `n` fit.
    let slots = |n: usize| {
        let mut s = 0;
        while s < n {
            s = (s * 2).max(4);
        }
        s as u64
    };
    let act_slot = (layers * BLOCK * hidden * 4) as u64;
    let kv_slot = (layers * 2 * BLOCK * nkv * d * 4) as u64;
    for i in 0..STEPS {
        let pos = prompt.len() + i;
        let ids = Tensor::new(&[(i % 64) as u32], &Device::Cpu)?.unsqueeze(0)?;
        model.forward(&ids, pos, p.as_mut(), LogitsMode::Last)?;
        let s = p.stats();
        let tokens = pos + 1;
        let n = tokens.div_ceil(BLOCK);
        // Block i is K/V when ⌊(i+1)/2⌋ > ⌊i/2⌋: the odd ones.
        let kv_blocks: Vec<usize> = (0..n).filter(|i| i % 2 == 1).collect();
        let act = n - kv_blocks.len();
        let kv_tokens: usize = kv_blocks
            .iter()
            .map(|&b| (tokens - b * BLOCK).min(BLOCK))
            .sum();
        assert_eq!(
            (
                common::metric(&s, "act_blocks"),
                common::metric(&s, "kv_blocks")
            ),
            (act as u64, kv_blocks.len() as u64)
        );
        assert_eq!(common::metric(&s, "device_blocks"), act as u64);
        assert_eq!(
            s.host_kv_bytes,
            slots(kv_blocks.len()) * kv_slot,
            "at {tokens}"
        );
        let staged = (kv_tokens * 2 * nkv * d * 4) as u64;
        assert_eq!(
            s.device_kv_bytes,
            slots(act) * act_slot + staged,
            "at {tokens} tokens"
        );
        assert!(s.recompute_tokens > 0);
    }
    Ok(())
}
