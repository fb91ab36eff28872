//! `hybrid` (HybridServe) against `full`: identical logits for every fixture, block size
//! and forced ratio; ragged batches equal each prompt run alone (for `hybrid` and `full`);
//! device-resident blocks within the budget; freed requests visible in the stats; the
//! derived ratio (all-KV for grouped-query models); clear errors.
mod common;

use anyhow::{Context, Result};
use kvpolicy::models::{generate, generate_batch, GenerateConfig, Generation, SeqChunk};
use kvpolicy::{build_policy, build_policy_batched, CausalLm, LogitsMode, PolicyOptions, Profile};

/// The `hybrid` spec with `block` tokens per block and a forced KV share `ratio`.
fn hybrid(block: usize, ratio: Option<f64>) -> String {
    match ratio {
        Some(r) => format!("hybrid:block_size={block},kv_act_ratio={r}"),
        None => format!("hybrid:block_size={block}"),
    }
}

#[test]
fn hybrid_logits_equal_full_for_every_block_size_and_ratio() -> Result<()> {
    for name in common::hf_fixtures() {
        let loaded = common::load_fixture(&name)?;
        let model = loaded.model.as_ref();
        let (prompt, decode) = common::fixture_ids(&name)?;
        for chunk in [0, 5] {
            let mut full = build_policy("full", &PolicyOptions::default())?;
            let want =
                common::teacher_forced_logits(model, full.as_mut(), &prompt, &decode, chunk)?;
            for block in [1, 4, 16] {
                for ratio in [Some(1.0), Some(0.5), Some(0.0), None] {
                    let mut p = build_policy(&hybrid(block, ratio), &PolicyOptions::default())?;
                    let got =
                        common::teacher_forced_logits(model, p.as_mut(), &prompt, &decode, chunk)?;
                    let d = common::max_abs_diff(&got, &want)?;
                    let st = p.stats();
                    println!(
                        "{name} chunk {chunk} block {block} ratio {ratio:?}: max |Δ| {d:.2e}, {} ACT / {} KV blocks",
                        common::metric(&st, "act_blocks"), common::metric(&st, "kv_blocks")
                    );
                    assert!(
                        d <= 1e-4,
                        "{name} chunk {chunk} block {block} ratio {ratio:?}: max |Δ| = {d}"
                    );
                    let s = (prompt.len() + decode.len()) as u64;
                    let blocks = s.div_ceil(block as u64);
                    assert_eq!(
                        common::metric(&st, "act_blocks") + common::metric(&st, "kv_blocks"),
                        blocks,
                        "{name}"
                    );
                    match ratio {
                        Some(1.0) => {
                            assert_eq!(
                                (common::metric(&st, "act_blocks"), st.recompute_tokens),
                                (0, 0),
                                "{name}"
                            )
                        }
                        Some(0.0) => assert_eq!(common::metric(&st, "kv_blocks"), 0, "{name}"),
                        Some(_) => assert!(
                            common::metric(&st, "act_blocks")
                                .abs_diff(common::metric(&st, "kv_blocks"))
                                <= 1
                                && st.recompute_tokens > 0,
                            "{name}: {st:?}"
                        ),
                        None => {}
                    }
                }
            }
        }
    }
    Ok(())
}

/// Prefixes of the fixture's ids of five different lengths.
fn five_prompts(name: &str) -> Result<Vec<Vec<u32>>> {
    let (prompt, decode) = common::fixture_ids(name)?;
    let all: Vec<u32> = prompt.iter().chain(&decode).copied().collect();
    Ok([3usize, 9, 5, 14, 1]
        .iter()
        .map(|&n| all[..n.min(all.len())].to_vec())
        .collect())
}

fn alone(model: &dyn CausalLm, prompt: &[u32], cfg: &GenerateConfig) -> Result<Generation> {
    let mut full = build_policy("full", &PolicyOptions::default())?;
    Ok(generate(
        model,
        full.as_mut(),
        prompt,
        cfg,
        &mut |_| Ok(()),
    )?)
}

#[test]
fn a_ragged_batch_equals_each_prompt_alone() -> Result<()> {
    let cfg = GenerateConfig {
        max_new_tokens: 6,
        collect_logits: true,
        stop_at_eos: false,
        ..GenerateConfig::default()
    };
    for name in common::hf_fixtures() {
        let loaded = common::load_fixture(&name)?;
        let model = loaded.model.as_ref();
        let prompts = five_prompts(&name)?;
        let want: Vec<Generation> = prompts
            .iter()
            .map(|p| alone(model, p, &cfg))
            .collect::<Result<_>>()?;
        let cases: Vec<(String, usize)> = vec![
            ("full".into(), 0),
            ("full".into(), 4),
            (hybrid(4, Some(0.5)), 0),
            (hybrid(1, Some(0.0)), 3),
            (hybrid(16, None), 0),
            ("layer".into(), 0),
        ];
        for (policy, chunk) in cases {
            let mut p = build_policy_batched(&policy, &PolicyOptions::default())?;
            let got = generate_batch(
                model,
                p.as_mut(),
                &prompts,
                &GenerateConfig {
                    prefill_chunk: chunk,
                    ..cfg.clone()
                },
            )?;
            for (i, (g, w)) in got.requests.iter().zip(&want).enumerate() {
                assert_eq!(g.prompt_ids, w.prompt_ids);
                assert_eq!(
                    g.generated_ids, w.generated_ids,
                    "{name} {policy} chunk {chunk}: prompt {i}"
                );
                let (Some(a), Some(b)) = (&g.logits, &w.logits) else {
                    anyhow::bail!("no logits");
                };
                let d = common::max_abs_diff(a, b)?;
                println!("batch {name} {policy} chunk {chunk} prompt {i}: max |Δ| {d:.2e}");
                assert!(d <= 1e-4, "{name} {policy} chunk {chunk} prompt {i}: {d}");
            }
            // Every request finished and was released.
            let last = got.step_stats.last().cloned().unwrap_or_default();
            assert_eq!(last.sequences, 0, "{name} {policy}");
            assert_eq!(
                common::metric(&last, "act_blocks") + common::metric(&last, "kv_blocks"),
                0,
                "{name} {policy}"
            );
        }
    }
    Ok(())
}

#[test]
fn resident_blocks_stay_within_the_budget_and_freed_requests_show() -> Result<()> {
    let name = "llama_mha";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    let prompts: Vec<Vec<u32>> = five_prompts(name)?;
    let new = 8;
    let max_tokens = prompts.iter().map(Vec::len).max().unwrap_or(0) + new;
    let f32b = 4u64;
    let kv_row = 2 * (info.n_kv_heads * info.head_dim) as u64 * f32b;
    let block = 2usize;
    let act_slot = (info.n_layers * block * info.hidden) as u64 * f32b;
    // Staging takes two units of the longest request (more than half of this budget);
    // what is left holds exactly 5 ACT blocks.
    let staging = 2 * max_tokens as u64 * kv_row;
    let slots = 5u64;
    assert!(slots * act_slot <= staging);
    // Plus a step's attention scratch and activations, planned as the policy plans them.
    let scratch = kvpolicy::models::engine::generate::kv_shape(&info, prompts.len(), max_tokens, 4)
        .step_scratch_bytes(info.n_kv_heads, max_tokens, &candle_core::Device::Cpu);
    let budget = staging + slots * act_slot + scratch;
    let opts = PolicyOptions {
        device_kv_budget: Some(budget),
        ..PolicyOptions::default()
    };
    // Prompts in chunks of 4: requests leave prefill, and finish, at different steps.
    let cfg = GenerateConfig {
        max_new_tokens: new,
        prefill_chunk: 4,
        collect_logits: true,
        stop_at_eos: false,
        ..GenerateConfig::default()
    };
    let mut p = build_policy_batched(&hybrid(block, Some(0.0)), &opts)?;
    let got = generate_batch(model, p.as_mut(), &prompts, &cfg)?;
    let mut most = 0;
    for st in &got.step_stats {
        assert!(
            common::metric(st, "device_blocks") <= slots,
            "{st:?} with {slots} slots"
        );
        assert!(st.device_kv_bytes <= budget && st.device_kv_peak_bytes <= budget);
        most = most.max(common::metric(st, "device_blocks"));
    }
    assert_eq!(most, slots, "the device pool fills up");
    // All-ACT, but the device holds only `slots` blocks: the rest went to the host.
    let peak_blocks = got
        .step_stats
        .iter()
        .map(|s| common::metric(s, "act_blocks"))
        .max()
        .unwrap_or(0);
    assert!(peak_blocks > slots);
    // Requests finish at different steps (their prompts differ), and each release shows.
    let seqs: Vec<u64> = got.step_stats.iter().map(|s| s.sequences).collect();
    assert!(seqs.windows(2).all(|w| w[1] <= w[0]), "{seqs:?}");
    assert_eq!(seqs.first().copied(), Some(5));
    assert_eq!(seqs.last().copied(), Some(0));
    assert!(seqs.iter().any(|&n| n > 0 && n < 5), "{seqs:?}");
    // A unit stages at most one request's K/V: the steps were split into mini-batches.
    assert!(got
        .step_stats
        .iter()
        .any(|s| common::metric(s, "mini_batches") > 1));
    // And still exact.
    for (g, p) in got.requests.iter().zip(&prompts) {
        let w = alone(model, p, &cfg)?;
        let (Some(a), Some(b)) = (&g.logits, &w.logits) else {
            anyhow::bail!("no logits");
        };
        assert!(common::max_abs_diff(a, b)? <= 1e-4);
        assert_eq!(g.generated_ids, w.generated_ids);
    }
    Ok(())
}

#[test]
fn releasing_a_request_returns_its_blocks() -> Result<()> {
    let name = "llama_mha";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let prompts = five_prompts(name)?;
    let mut p = build_policy_batched(&hybrid(2, Some(0.5)), &PolicyOptions::default())?;
    let chunks: Vec<SeqChunk> = prompts
        .iter()
        .enumerate()
        .map(|(i, ids)| SeqChunk {
            seq: i,
            pos: 0,
            ids: ids.clone(),
        })
        .collect();
    model.forward_batch(&[chunks], p.as_mut(), LogitsMode::Last)?;
    let before = p.stats();
    let blocks_of = |n: usize| n.div_ceil(2) as u64;
    let total: u64 = prompts.iter().map(|q| blocks_of(q.len())).sum();
    assert_eq!(
        common::metric(&before, "act_blocks") + common::metric(&before, "kv_blocks"),
        total
    );
    assert_eq!(before.sequences, 5);
    p.as_batched().context("hybrid is batched")?.release(3);
    let after = p.stats();
    assert_eq!(
        common::metric(&after, "act_blocks") + common::metric(&after, "kv_blocks"),
        total - blocks_of(prompts[3].len())
    );
    assert_eq!(after.sequences, 4);
    // Memory stays allocated (pools are reused), only the blocks are free.
    assert_eq!(after.host_kv_bytes, before.host_kv_bytes);
    Ok(())
}

#[test]
fn grouped_query_models_derive_all_kv() -> Result<()> {
    // Even with regeneration far cheaper than the transfer, X is larger than K+V for GQA.
    let fast = Profile {
        h2d_bytes_per_s: 1e6,
        recompute_tokens_per_s: 1e12,
        device: None,
        shape: None,
    };
    for (name, all_kv) in [
        ("llama_gqa", true),
        ("llama3_rope", true),
        ("llama_mha", false),
    ] {
        let loaded = common::load_fixture(name)?;
        let model = loaded.model.as_ref();
        let (prompt, decode) = common::fixture_ids(name)?;
        let opts = PolicyOptions {
            profile: Some(fast.clone()),
            ..PolicyOptions::default()
        };
        let mut p = build_policy(&hybrid(4, None), &opts)?;
        common::teacher_forced_logits(model, p.as_mut(), &prompt, &decode, 0)?;
        let st = p.stats();
        if all_kv {
            assert_eq!(
                (common::metric(&st, "act_blocks"), st.recompute_tokens),
                (0, 0),
                "{name}"
            );
        } else {
            assert!(
                common::metric(&st, "act_blocks") > 0 && st.recompute_tokens > 0,
                "{name}: {st:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn smollm2_greedy_ids_equal_full() -> Result<()> {
    let loaded = common::load_default_gguf()?;
    let model = loaded.model.as_ref();
    let prompt = common::greedy_reference_prompt()?;
    let cfg = GenerateConfig {
        max_new_tokens: 16,
        stop_at_eos: false,
        ..GenerateConfig::default()
    };
    let want = alone(model, &prompt, &cfg)?.generated_ids;
    for ratio in [Some(1.0), Some(0.5), Some(0.0), None] {
        let mut p = build_policy(&hybrid(16, ratio), &PolicyOptions::default())?;
        let got = generate(model, p.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?.generated_ids;
        assert_eq!(got, want, "ratio {ratio:?}");
    }
    // And in a batch with two shorter prompts.
    let n = prompt.len();
    let prompts = vec![
        prompt.clone(),
        prompt[..n / 2].to_vec(),
        prompt[1..].to_vec(),
    ];
    let mut p = build_policy_batched(&hybrid(4, Some(0.5)), &PolicyOptions::default())?;
    let got = generate_batch(model, p.as_mut(), &prompts, &cfg)?;
    for (g, q) in got.requests.iter().zip(&prompts) {
        assert_eq!(g.generated_ids, alone(model, q, &cfg)?.generated_ids);
    }
    Ok(())
}

#[test]
fn bad_options_are_clear_errors() -> Result<()> {
    let msg = |spec: String| {
        build_policy(&spec, &PolicyOptions::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = msg(hybrid(0, None));
    assert!(e.contains("`block_size` 0"), "{e}");
    for r in [-0.5, 1.5, f64::NAN] {
        let e = msg(hybrid(16, Some(r)));
        assert!(
            e.contains("`kv_act_ratio`") && e.contains("outside [0, 1]"),
            "{e}"
        );
    }
    // A single-sequence policy cannot run a ragged batch.
    let loaded = common::load_fixture("llama_mha")?;
    let model = loaded.model.as_ref();
    let mut full = build_policy("full", &PolicyOptions::default())?;
    let e = generate_batch(
        model,
        full.as_mut(),
        &[vec![1, 2], vec![3]],
        &GenerateConfig::default(),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(e.contains("build_policy_batched"), "{e}");
    // An empty prompt in a batch names its index.
    let mut p = build_policy_batched(&hybrid(4, None), &PolicyOptions::default())?;
    let e = generate_batch(
        model,
        p.as_mut(),
        &[vec![1, 2], vec![]],
        &GenerateConfig::default(),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(e.contains("prompt 2 of the batch"), "{e}");
    Ok(())
}

#[test]
fn one_policy_serves_models_of_different_shapes_in_turn() -> Result<()> {
    let mut p = build_policy(&hybrid(4, Some(0.5)), &PolicyOptions::default())?;
    for name in ["llama_mha", "gemma", "llama_mha"] {
        let loaded = common::load_fixture(name)?;
        let model = loaded.model.as_ref();
        let (prompt, decode) = common::fixture_ids(name)?;
        let mut full = build_policy("full", &PolicyOptions::default())?;
        let want = common::teacher_forced_logits(model, full.as_mut(), &prompt, &decode, 0)?;
        p.reset();
        let got = common::teacher_forced_logits(model, p.as_mut(), &prompt, &decode, 0)?;
        let d = common::max_abs_diff(&got, &want)?;
        assert!(d <= 1e-4, "{name}: {d}");
    }
    Ok(())
}
