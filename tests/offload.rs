//! `layer` and `headwise` against `full`: identical logits, exact device-memory bounds,
//! exact per-step traffic, and clear errors for options that cannot work.
mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::models::engine::generate::{chunk_len, kv_shape};
use kvpolicy::models::load::source::ModelFiles;
use kvpolicy::models::{generate, load, prefill, GenerateConfig};
use kvpolicy::{build_policy, HeadGroup, PolicyOptions};

fn opts(grow: usize, budget: Option<u64>) -> PolicyOptions {
    PolicyOptions {
        grow_tokens: grow,
        device_kv_budget: budget,
        ..PolicyOptions::default()
    }
}

#[test]
fn offload_logits_equal_full() -> Result<()> {
    for name in common::hf_fixtures() {
        let loaded = common::load_fixture(&name)?;
        let model = loaded.model.as_ref();
        let nkv = model.info().n_kv_heads;
        let (prompt, decode) = common::fixture_ids(&name)?;
        for chunk in [1, 5, 16, 64] {
            let mut full = build_policy(&common::spec("full", HeadGroup::Auto), &opts(256, None))?;
            let want = common::teacher_forced(model, full.as_mut(), &prompt, &decode, chunk)?
                .logits
                .unwrap_or(Tensor::zeros(1, DType::F32, &Device::Cpu)?);
            let mut cases = vec![("layer", HeadGroup::Auto)];
            for g in [HeadGroup::Fixed(1), HeadGroup::Fixed(2), HeadGroup::Auto] {
                if let HeadGroup::Fixed(n) = g {
                    if nkv % n != 0 {
                        continue;
                    }
                }
                cases.push(("headwise", g));
            }
            for (policy, group) in cases {
                // grow 4: buffers regrow many times mid-run; 256: one allocation.
                for grow in [4, 256] {
                    let mut p = build_policy(&common::spec(policy, group), &opts(grow, None))?;
                    let got =
                        common::teacher_forced(model, p.as_mut(), &prompt, &decode, chunk)?.logits;
                    let got = got.ok_or_else(|| anyhow::anyhow!("no logits"))?;
                    let d = common::max_abs_diff(&got, &want)?;
                    assert!(
                        d <= 1e-5,
                        "{name} {policy} {group:?} chunk {chunk} grow {grow}: max |Δ| = {d}"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn device_memory_is_two_unit_buffers() -> Result<()> {
    let name = "llama_gqa";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    let (prompt, decode) = common::fixture_ids(name)?;
    let cap = 256; // one growth step covers the 32 tokens
    let unit = |heads: usize| (2 * heads * cap * info.head_dim * 2 * 4) as u64;
    for (policy, group, heads) in [
        ("headwise", HeadGroup::Fixed(1), 1),
        ("headwise", HeadGroup::Fixed(2), 2),
        ("layer", HeadGroup::Auto, 2),
    ] {
        let mut p = build_policy(&common::spec(policy, group), &opts(cap, None))?;
        common::teacher_forced(model, p.as_mut(), &prompt, &decode, 5)?;
        let s = p.stats();
        assert_eq!(s.device_kv_peak_bytes, unit(heads), "{policy} {group:?}");
        assert_eq!(s.device_kv_bytes, unit(heads));
        // The host holds every layer's KV for the run's planned tokens: it ends inside the
        // first growth chunk (8 × 256 tokens), so no store holds the whole chunk.
        let planned = prompt.len() + decode.len();
        assert_eq!(
            s.host_kv_bytes,
            (info.n_layers * info.n_kv_heads * planned * info.head_dim * 2 * 4) as u64
        );
    }
    let mut full = build_policy(&common::spec("full", HeadGroup::Auto), &opts(cap, None))?;
    common::teacher_forced(model, full.as_mut(), &prompt, &decode, 5)?;
    assert_eq!(
        full.stats().device_kv_peak_bytes,
        (info.n_layers * info.n_kv_heads * cap * info.head_dim * 2 * 4) as u64
    );
    Ok(())
}

#[test]
fn each_decode_step_moves_the_history_once_and_only_new_entries_back() -> Result<()> {
    let name = "llama_gqa";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    let (prompt, decode) = common::fixture_ids(name)?;
    let per_token = (info.n_layers * info.n_kv_heads * info.head_dim * 2 * 4) as u64; // K+V, all layers, f32

    // Prepared for the run's length, so units of each next step are staged during the step
    // before (with buffers that never grow) — counted in the step that uses them.
    let run = prompt.len() + decode.len();
    for (policy, group, grow) in [
        ("layer", HeadGroup::Auto, 8),
        ("headwise", HeadGroup::Fixed(1), 8),
        ("layer", HeadGroup::Auto, 1024),
        ("headwise", HeadGroup::Fixed(1), 1024),
    ] {
        let mut p = build_policy(&common::spec(policy, group), &opts(grow, None))?;
        p.prepare(&kv_shape(&info, 1, run, 0))?;
        prefill(model, p.as_mut(), &prompt, 0, false)?;
        for (pos, &tok) in (prompt.len()..).zip(decode.iter()) {
            let before = p.stats();
            let ids = Tensor::new(&[tok], &Device::Cpu)?.unsqueeze(0)?;
            model.forward(&ids, pos, p.as_mut(), kvpolicy::LogitsMode::Last)?;
            let after = p.stats();
            assert_eq!(
                after.h2d_bytes - before.h2d_bytes,
                pos as u64 * per_token,
                "{policy} at {pos}: h2d"
            );
            assert_eq!(
                after.d2h_bytes - before.d2h_bytes,
                per_token,
                "{policy} at {pos}: d2h"
            );
        }
    }
    Ok(())
}

#[test]
fn smollm2_greedy_ids_equal_full_and_memory_ratio() -> Result<()> {
    let loaded = load(
        &ModelFiles::Gguf(common::default_gguf()?),
        &Device::Cpu,
        DType::F32,
        None,
    )?;
    let model = loaded.model.as_ref();
    let refs = common::llamacpp_refs()?;
    let cfg = GenerateConfig {
        max_new_tokens: 32,
        stop_at_eos: false,
        ..GenerateConfig::default()
    };
    for g in refs["greedy"].as_array().into_iter().flatten() {
        let prompt = common::ids_of(&g["prompt_ids"])?;
        let mut full = build_policy("full", &PolicyOptions::default())?;
        let want = generate(model, full.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?.generated_ids;
        for (policy, group) in [
            ("layer", HeadGroup::Auto),
            ("headwise", HeadGroup::Fixed(1)),
            ("headwise", HeadGroup::Auto),
        ] {
            let mut p = build_policy(&common::spec(policy, group), &opts(256, None))?;
            let got = generate(model, p.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?.generated_ids;
            assert_eq!(got, want, "{policy} {group:?}");
            if group == HeadGroup::Fixed(1) {
                // HeadInfer's claim at SmolLM2's shape: 2 buffers of 1 head vs 30 layers × 3 heads.
                let (a, b) = (
                    p.stats().device_kv_peak_bytes,
                    full.stats().device_kv_peak_bytes,
                );
                assert_eq!(a * 90, b * 2, "headwise(1) {a} vs full {b}");
            }
        }
    }
    Ok(())
}

#[test]
fn options_that_cannot_work_are_clear_errors() -> Result<()> {
    let name = "llama_gqa"; // 2 KV heads of 16, 3 layers, f32
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let (prompt, _) = common::fixture_ids(name)?;
    let cfg = GenerateConfig {
        max_new_tokens: 4,
        ..GenerateConfig::default()
    };
    let err = |policy: &str, o: PolicyOptions| -> Result<String> {
        let mut p = build_policy(policy, &o)?;
        match generate(model, p.as_mut(), &prompt, &cfg, &mut |_| Ok(())) {
            Ok(_) => anyhow::bail!("{policy} {o:?} succeeded"),
            Err(e) => Ok(e.to_string()),
        }
    };
    let e = err(
        &common::spec("headwise", HeadGroup::Fixed(3)),
        opts(256, None),
    )?;
    assert!(
        e.contains("`group` 3 does not divide the model's 2 KV heads; use one of 1, 2 or auto"),
        "{e}"
    );
    let e = err(
        &common::spec("headwise", HeadGroup::Fixed(4)),
        opts(256, None),
    )?;
    assert!(e.contains("does not divide"), "{e}");
    // The budget also holds a step's scratch (attention over one unit, the activations),
    // planned from the shape the generation loop passes.
    let shape = kv_shape(
        model.info(),
        1,
        prompt.len() + cfg.max_new_tokens,
        chunk_len(cfg.prefill_chunk, prompt.len()),
    );
    let scratch = |heads: usize| shape.step_scratch_bytes(heads, 256, &Device::Cpu);
    assert!(scratch(1) > 0 && scratch(2) >= scratch(1));
    // One head's two buffers at 256 tokens: 2 × 256 × 16 × 2 × 4 = 65536 bytes.
    let e = err(
        &common::spec("headwise", HeadGroup::Auto),
        opts(256, Some(65_535 + scratch(1))),
    )?;
    assert!(
        e.contains("budget is smaller than one head group's buffers"),
        "{e}"
    );
    let e = err(
        &common::spec("full", HeadGroup::Auto),
        opts(256, Some(100_000)),
    )?;
    assert!(e.contains("use the `headwise` policy"), "{e}");
    // Auto under a budget picks the largest group that fits: 2 heads need 131072 bytes.
    let mut p = build_policy(
        &common::spec("headwise", HeadGroup::Auto),
        &opts(256, Some(65_536 + scratch(1))),
    )?;
    generate(model, p.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?;
    assert_eq!(p.stats().device_kv_peak_bytes, 65_536);
    let mut p = build_policy(
        &common::spec("headwise", HeadGroup::Auto),
        &opts(256, Some(131_071 + scratch(2))),
    )?;
    generate(model, p.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?;
    assert_eq!(p.stats().device_kv_peak_bytes, 65_536);
    let mut p = build_policy(
        &common::spec("headwise", HeadGroup::Auto),
        &opts(256, Some(131_072 + scratch(2))),
    )?;
    generate(model, p.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?;
    assert_eq!(p.stats().device_kv_peak_bytes, 131_072);
    // What the steps held besides the KV stayed within what was planned.
    let st = p.stats();
    assert!(st.attn_scratch_peak_bytes > 0);
    assert!(st.device_scratch_peak_bytes <= scratch(2), "{st:?}");
    Ok(())
}

#[test]
fn library_errors_are_typed_and_name_no_flags() -> Result<()> {
    use kvpolicy::core::Advice;
    use kvpolicy::{KvError, PolicyOption};
    let name = "llama_gqa";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let (prompt, _) = common::fixture_ids(name)?;
    let cfg = GenerateConfig {
        max_new_tokens: 2,
        ..GenerateConfig::default()
    };
    // A budget below one layer's double buffer: advice, not flags.
    let mut p = build_policy(
        &common::spec("layer", HeadGroup::Auto),
        &opts(256, Some(10)),
    )?;
    let e = generate(model, p.as_mut(), &prompt, &cfg, &mut |_| Ok(()))
        .err()
        .ok_or_else(|| anyhow::anyhow!("layer fit 10 bytes"))?;
    match &e {
        kvpolicy::models::ModelError::Policy(KvError::BudgetExceeded {
            advice, budget, ..
        }) => {
            assert_eq!(*budget, 10);
            assert_eq!(
                advice,
                &[
                    Advice::Raise(PolicyOption::DeviceKvBudget.into()),
                    Advice::UsePolicy("headwise")
                ]
            );
        }
        other => anyhow::bail!("expected a budget error, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(!msg.contains("--"), "{msg}");
    assert!(msg.contains("raise `device_kv_budget`"), "{msg}");
    // A step that does not continue the sequence: which layer, how many held, where.
    for policy in ["full", "layer", "headwise", "recompute", "auto"] {
        let mut p = build_policy(&common::spec(policy, HeadGroup::Auto), &opts(256, None))?;
        prefill(model, p.as_mut(), &prompt, prompt.len(), false)?;
        match prefill(model, p.as_mut(), &prompt, prompt.len(), false) {
            Err(kvpolicy::models::ModelError::Policy(KvError::OutOfOrder {
                layer,
                held,
                pos,
                ..
            })) => assert_eq!((layer, held, pos), (0, prompt.len(), 0), "{policy}"),
            other => anyhow::bail!("{policy}: expected OutOfOrder, got {other:?}"),
        }
    }
    Ok(())
}

/// What the link saw: each batch's bytes in submission order, and for every wait the
/// ticket waited for and the batches submitted by then.
#[derive(Default)]
struct LinkLog {
    batches: Vec<u64>,
    waits: Vec<(u64, usize)>,
}

/// A synchronous engine that logs into a shared [`LinkLog`].
struct Logging {
    inner: kvpolicy::tiered::SyncTransferEngine,
    log: std::sync::Arc<std::sync::Mutex<LinkLog>>,
}

impl kvpolicy::tiered::TransferEngine for Logging {
    fn submit(
        &mut self,
        jobs: Vec<kvpolicy::tiered::CopyJob>,
    ) -> kvpolicy::core::Result<kvpolicy::tiered::Ticket> {
        let bytes = jobs.iter().map(kvpolicy::tiered::CopyJob::bytes).sum();
        if let Ok(mut l) = self.log.lock() {
            l.batches.push(bytes);
        }
        self.inner.submit(jobs)
    }
    fn wait(&mut self, t: kvpolicy::tiered::Ticket) -> kvpolicy::core::Result<f64> {
        if let Ok(mut l) = self.log.lock() {
            let n = l.batches.len();
            l.waits.push((t.0, n));
        }
        self.inner.wait(t)
    }
    fn wait_all(&mut self) -> kvpolicy::core::Result<f64> {
        self.inner.wait_all()
    }
}

/// The link is never left idle while the compute waits (issue: exact offload at the link's
/// bound): whenever a unit's copy is waited for, the copy of a later unit has already been
/// queued behind it — within a step, across layers and into the next step — except for the
/// last unit of the run's last two steps (nothing is staged for the step at
/// `max_tokens - 1`, which a sampled run never runs). (Write-backs, one decode token per
/// head, do not count as loads.)
#[test]
fn a_later_load_is_queued_whenever_a_load_is_waited_for() -> Result<()> {
    use kvpolicy::offload::{Grouping, OffloadPolicy};
    use kvpolicy::KvPolicy;
    let name = "llama_gqa";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    let (prompt, decode) = common::fixture_ids(name)?;
    // A decode step writes one token of each of a unit's heads back (f32): one head under
    // headwise:1, every KV head under layer.
    let write_back = |heads: usize| (2 * heads * info.head_dim * 4) as u64;
    for (policy, grouping) in [
        ("headwise", Grouping::Heads(HeadGroup::Fixed(1))),
        ("layer", Grouping::Layer),
    ] {
        let log = std::sync::Arc::new(std::sync::Mutex::new(LinkLog::default()));
        let engine = Logging {
            inner: kvpolicy::tiered::SyncTransferEngine::default(),
            log: log.clone(),
        };
        // Buffers large enough never to grow: growing drops what was staged.
        let mut p =
            OffloadPolicy::new(policy, grouping, &opts(1024, None))?.with_engine(Box::new(engine));
        let p: &mut dyn KvPolicy = &mut p;
        common::teacher_forced(model, p, &prompt, &decode, 0)?;
        let l = log
            .lock()
            .map_err(|_| anyhow::anyhow!("the log's lock is poisoned"))?;
        let heads = if policy == "layer" {
            info.n_kv_heads
        } else {
            1
        };
        let loads_after = |ticket: u64, submitted: usize| {
            l.batches[ticket as usize..submitted]
                .iter()
                .any(|&b| b != write_back(heads))
        };
        let lonely = l.waits.iter().filter(|&&(t, n)| !loads_after(t, n)).count();
        assert!(
            l.waits.len() > decode.len(),
            "{policy}: {} waits",
            l.waits.len()
        );
        assert_eq!(lonely, 2, "{policy}: waits with no later load queued");
    }
    Ok(())
}
