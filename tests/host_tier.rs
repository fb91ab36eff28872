//! The host tier's life cycle through the transfer engine: every host buffer of `layer`,
//! `headwise`, `recompute` and `hybrid` is allocated by the engine (`host_zeros`, which the
//! CUDA engine page-locks) and handed back (`host_release`) before it is dropped — when a
//! buffer grows, and at `reset()`. A ledger engine records both, so on the CPU we can assert
//! what the CUDA engine relies on: locked bytes equal the host tier's bytes after every step,
//! nothing is released twice or unknown, and nothing stays locked after a reset (nor counted:
//! the copy time starts again from zero).
mod common;

use std::sync::{Arc, Mutex};

use anyhow::Result;
use candle_core::{DType, Device, Shape, Tensor, TensorId};
use kvpolicy::hybrid::{HybridPolicy, HybridSettings};
use kvpolicy::models::prefill;
use kvpolicy::offload::{Grouping, OffloadPolicy};
use kvpolicy::recompute::{RecomputePolicy, RecomputeSettings};
use kvpolicy::tiered::{CopyJob, CpuTransferEngine, Ticket, TransferEngine};
use kvpolicy::{build_policy, HeadGroup, KvPolicy, LogitsMode, PolicyOptions};

#[derive(Default)]
struct Ledger {
    live: Vec<(TensorId, u64)>,
    bad_releases: usize,
}

/// A CPU engine that books host buffers as if it page-locked them.
struct Locking {
    inner: CpuTransferEngine,
    ledger: Arc<Mutex<Ledger>>,
}

impl TransferEngine for Locking {
    fn submit(&mut self, jobs: Vec<CopyJob>) -> kvpolicy::core::Result<Ticket> {
        self.inner.submit(jobs)
    }
    fn wait(&mut self, t: Ticket) -> kvpolicy::core::Result<f64> {
        self.inner.wait(t)
    }
    fn wait_all(&mut self) -> kvpolicy::core::Result<f64> {
        self.inner.wait_all()
    }
    fn host_zeros(&mut self, shape: Shape, dtype: DType) -> kvpolicy::core::Result<Tensor> {
        let t = Tensor::zeros(shape, dtype, &Device::Cpu)?;
        let bytes = (t.elem_count() * dtype.size_in_bytes()) as u64;
        if let Ok(mut l) = self.ledger.lock() {
            l.live.push((t.id(), bytes));
        }
        Ok(t)
    }
    fn host_release(&mut self, buffer: &Tensor) -> kvpolicy::core::Result<()> {
        if let Ok(mut l) = self.ledger.lock() {
            match l.live.iter().position(|(id, _)| *id == buffer.id()) {
                Some(i) => {
                    l.live.swap_remove(i);
                }
                None => l.bad_releases += 1,
            }
        }
        Ok(())
    }
    fn copy_seconds(&self) -> f64 {
        self.inner.copy_seconds()
    }
    fn pinned_bytes(&self) -> u64 {
        self.ledger
            .lock()
            .map_or(0, |l| l.live.iter().map(|(_, b)| b).sum())
    }
}

fn policy(kind: &str, ledger: &Arc<Mutex<Ledger>>) -> Result<Box<dyn KvPolicy>> {
    let engine = Box::new(Locking {
        inner: CpuTransferEngine::new()?,
        ledger: Arc::clone(ledger),
    });
    // Small growth steps: host buffers are replaced many times in a short run.
    let opts = PolicyOptions {
        grow_tokens: 2,
        ..PolicyOptions::default()
    };
    Ok(match kind {
        "layer" => {
            Box::new(OffloadPolicy::new("layer", Grouping::Layer, &opts)?.with_engine(engine))
        }
        "headwise" => Box::new(
            OffloadPolicy::new("headwise", Grouping::Heads(HeadGroup::Fixed(1)), &opts)?
                .with_engine(engine),
        ),
        "recompute" => Box::new(
            RecomputePolicy::new(&opts, RecomputeSettings { split: Some(6) })?.with_engine(engine),
        ),
        _ => Box::new(
            HybridPolicy::new(
                &opts,
                HybridSettings {
                    block_size: 2,
                    kv_act_ratio: Some(0.5),
                },
            )?
            .with_engine(engine),
        ),
    })
}

#[test]
fn host_buffers_come_from_the_engine_and_go_back() -> Result<()> {
    for name in common::hf_fixtures() {
        let loaded = common::load_fixture(&name)?;
        let model = loaded.model.as_ref();
        let (prompt, decode) = common::fixture_ids(&name)?;
        let mut full = build_policy("full", &PolicyOptions::default())?;
        let want = common::teacher_forced_logits(model, full.as_mut(), &prompt, &decode, 5)?;
        for kind in ["layer", "headwise", "recompute", "hybrid"] {
            let ledger = Arc::new(Mutex::new(Ledger::default()));
            let mut p = policy(kind, &ledger)?;
            // Twice: the second run starts from a reset policy.
            for round in 0..2 {
                // The shape announces the layers reading another's cache (MLKV fixtures).
                let total = prompt.len() + decode.len();
                p.prepare(&kvpolicy::models::engine::generate::kv_shape(
                    model.info(),
                    1,
                    total,
                    5,
                ))?;
                prefill(model, p.as_mut(), &prompt, 5, false)?;
                for (i, &tok) in decode.iter().enumerate() {
                    let s = p.stats();
                    assert!(s.host_kv_bytes > 0, "{name} {kind}: nothing on the host");
                    assert_eq!(
                        s.host_pinned_bytes, s.host_kv_bytes,
                        "{name} {kind} round {round} step {i}: a host buffer bypassed the engine, or a grown one was not handed back"
                    );
                    let x = Tensor::new(&[tok], &Device::Cpu)?.unsqueeze(0)?;
                    model.forward(&x, prompt.len() + i, p.as_mut(), LogitsMode::Last)?;
                }
                assert!(
                    p.stats().copy_s > 0.0,
                    "{name} {kind}: no copy time counted"
                );
                p.reset();
                // Counters start again from a reset, the engine's copy time included.
                assert_eq!(
                    p.stats().copy_s,
                    0.0,
                    "{name} {kind}: copy time survived reset"
                );
                let l = ledger
                    .lock()
                    .map_err(|_| anyhow::anyhow!("ledger poisoned"))?;
                assert!(
                    l.live.is_empty(),
                    "{name} {kind}: {} host buffer(s) still locked after reset",
                    l.live.len()
                );
                assert_eq!(
                    l.bad_releases, 0,
                    "{name} {kind}: unknown or double release"
                );
            }
            // And the results are still `full`'s.
            let got = common::teacher_forced_logits(model, p.as_mut(), &prompt, &decode, 5)?;
            let d = common::max_abs_diff(&got, &want)?;
            assert!(d <= 1e-4, "{name} {kind}: max |Δ| = {d}");
        }
    }
    Ok(())
}
