//! Fault injection: a transfer engine that fails on the n-th batch. The error reaches the
//! caller of `forward`, and `reset()` followed by a rerun gives exactly `full`'s logits —
//! no half-filled buffer is ever read.
mod common;

use anyhow::Result;
use candle_core::Tensor;
use kvpolicy::hybrid::{HybridPolicy, HybridSettings};
use kvpolicy::models::{generate, GenerateConfig};
use kvpolicy::offload::{Grouping, OffloadPolicy};
use kvpolicy::recompute::{RecomputePolicy, RecomputeSettings};
use kvpolicy::tiered::{CopyJob, CpuTransferEngine, Ticket, TransferEngine};
use kvpolicy::{build_policy, CausalLm, HeadGroup, KvError, KvPolicy, PolicyOptions};

/// Fails the `fail_at`-th submission (from 1), once; everything else goes to a CPU engine.
struct Faulty {
    inner: CpuTransferEngine,
    fail_at: u64,
    submitted: u64,
}

impl TransferEngine for Faulty {
    fn submit(&mut self, jobs: Vec<CopyJob>) -> kvpolicy::core::Result<Ticket> {
        self.submitted += 1;
        if self.submitted == self.fail_at {
            return Err(KvError::Transfer("injected transfer failure".into()));
        }
        self.inner.submit(jobs)
    }
    fn wait(&mut self, t: Ticket) -> kvpolicy::core::Result<f64> {
        self.inner.wait(t)
    }
    fn wait_all(&mut self) -> kvpolicy::core::Result<f64> {
        self.inner.wait_all()
    }
}

fn faulty(fail_at: u64) -> Result<Box<dyn TransferEngine>> {
    Ok(Box::new(Faulty {
        inner: CpuTransferEngine::new()?.with_inline_bytes(0),
        fail_at,
        submitted: 0,
    }))
}

fn policy(kind: &str, fail_at: u64) -> Result<Box<dyn KvPolicy>> {
    let opts = PolicyOptions {
        grow_tokens: 8,
        ..PolicyOptions::default()
    };
    Ok(match kind {
        "layer" => Box::new(
            OffloadPolicy::new("layer", Grouping::Layer, &opts)?.with_engine(faulty(fail_at)?),
        ),
        "headwise" => Box::new(
            OffloadPolicy::new("headwise", Grouping::Heads(HeadGroup::Fixed(1)), &opts)?
                .with_engine(faulty(fail_at)?),
        ),
        "hybrid" => Box::new(
            HybridPolicy::new(
                &opts,
                HybridSettings {
                    block_size: 2,
                    kv_act_ratio: Some(0.5),
                },
            )?
            .with_engine(faulty(fail_at)?),
        ),
        _ => Box::new(
            RecomputePolicy::new(&opts, RecomputeSettings { split: Some(12) })?
                .with_engine(faulty(fail_at)?),
        ),
    })
}

fn run(
    model: &dyn CausalLm,
    p: &mut dyn KvPolicy,
    prompt: &[u32],
    decode: &[u32],
) -> Result<Tensor> {
    let cfg = GenerateConfig {
        prefill_chunk: 5,
        decode_ids: Some(decode.to_vec()),
        collect_logits: true,
        ..GenerateConfig::default()
    };
    generate(model, p, prompt, &cfg, &mut |_| Ok(()))?
        .logits
        .ok_or_else(|| anyhow::anyhow!("no logits"))
}

#[test]
fn a_failed_transfer_is_reported_and_reset_recovers_exactly() -> Result<()> {
    for name in ["llama_mha", "mistral"] {
        let loaded = common::load_fixture(name)?;
        let model = loaded.model.as_ref();
        let (prompt, decode) = common::fixture_ids(name)?;
        let mut full = build_policy("full", &PolicyOptions::default())?;
        let want = run(model, full.as_mut(), &prompt, &decode)?;
        for kind in ["layer", "headwise", "recompute", "hybrid"] {
            // hybrid submits one batch per (layer, sequence) with a cache: fewer in all.
            let points: &[u64] = if kind == "hybrid" {
                &[1, 2, 3, 7, 20, 30]
            } else {
                &[1, 2, 3, 7, 20, 50]
            };
            for &fail_at in points {
                let mut p = policy(kind, fail_at)?;
                let e = run(model, p.as_mut(), &prompt, &decode)
                    .err()
                    .map(|e| format!("{e:#}"))
                    .unwrap_or_default();
                assert!(
                    e.contains("injected transfer failure"),
                    "{name} {kind} fail at {fail_at}: {e:?}"
                );
                p.reset();
                let got = run(model, p.as_mut(), &prompt, &decode)?;
                let d = common::max_abs_diff(&got, &want)?;
                assert!(d <= 1e-4, "{name} {kind} after a failure at {fail_at}: {d}");
            }
        }
    }
    Ok(())
}
