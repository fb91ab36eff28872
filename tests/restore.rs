//! `KvRestore::append_kv` (K/V stored without computing attention: a restored session, or
//! `kvbench --synthetic-history`): the K/V a `full` prefill stored, appended into `full`,
//! `layer`, `headwise` and `auto` — in host RAM, on disk, or half and half; `auto` with
//! every unit resident, and under a budget that keeps one resident and streams the rest —
//! continue the sequence exactly: the decode logits equal a prefilled `full`'s (≤ 1e-5).
//! Policies that store something else (`recompute`, `hybrid`) refuse with `Unsupported`.
mod common;

use anyhow::Result;
use candle_core::{Device, Tensor};
use kvpolicy::models::engine::generate::kv_shape;
use kvpolicy::models::prefill;
use kvpolicy::{
    build_policy, AttnSpec, AttnStep, CausalLm, KvError, KvPolicy, KvStats, LogitsMode, NoRegen,
    PolicyOptions,
};

/// One attention step's inputs, as the model gave them.
struct Recorded {
    layer: usize,
    pos: usize,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    x: Tensor,
    spec: AttnSpec,
}

/// `full`, keeping a copy of every step it serves.
struct Recorder {
    inner: Box<dyn KvPolicy>,
    steps: Vec<Recorded>,
}

impl KvPolicy for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor, KvError> {
        self.steps.push(Recorded {
            layer: step.layer,
            pos: step.pos,
            q: step.q.clone(),
            k: step.k.clone(),
            v: step.v.clone(),
            x: step.x.clone(),
            spec: step.spec.clone(),
        });
        self.inner.attend(step)
    }

    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }

    fn reset(&mut self) {
        self.inner.reset();
        self.steps.clear();
    }

    fn stats(&self) -> KvStats {
        self.inner.stats()
    }
}

/// Appends every recorded step into `p`.
fn restore(p: &mut dyn KvPolicy, steps: &[Recorded]) -> Result<(), KvError> {
    for s in steps {
        kvpolicy::core::append_kv(
            p,
            &AttnStep {
                layer: s.layer,
                seq: 0,
                q: &s.q,
                k: &s.k,
                v: &s.v,
                x: &s.x,
                pos: s.pos,
                spec: &s.spec,
                regen: &NoRegen,
            },
        )?;
    }
    Ok(())
}

/// The logits of `decode`, one token per step after `at` cached tokens, `(steps, vocab)`.
fn decode_logits(
    model: &dyn CausalLm,
    p: &mut dyn KvPolicy,
    at: usize,
    decode: &[u32],
) -> Result<Tensor> {
    let mut rows = Vec::new();
    for (i, &tok) in decode.iter().enumerate() {
        let ids = Tensor::new(&[tok], &Device::Cpu)?.unsqueeze(0)?;
        let logits = model.forward(&ids, at + i, p, LogitsMode::Last)?;
        rows.push(logits.flatten_all()?);
    }
    Ok(Tensor::stack(&rows, 0)?)
}

#[test]
fn appended_kv_continues_the_sequence_exactly() -> Result<()> {
    let name = "llama_gqa";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let (prompt, decode) = common::fixture_ids(name)?;
    let mut rec = Recorder {
        inner: build_policy("full", &PolicyOptions::default())?,
        steps: Vec::new(),
    };
    prefill(model, &mut rec, &prompt, 5, false)?;
    let want = decode_logits(model, &mut rec, prompt.len(), &decode)?;
    let steps = &rec.steps[..rec.steps.len() - decode.len() * model.info().n_layers];

    let dir = tempfile::tempdir()?;
    // One layer's K/V at the prompt's length, in bytes: room in RAM for about half.
    let info = model.info();
    let layer = (2 * info.n_kv_heads * prompt.len() * info.head_dim * 4) as u64;
    let disk = |budget: Option<u64>| PolicyOptions {
        grow_tokens: 4,
        disk_dir: Some(dir.path().to_path_buf()),
        host_kv_budget: budget,
        ..PolicyOptions::default()
    };
    // `auto` under a budget for the streaming buffers, a step's scratch and one unit.
    let total = prompt.len() + decode.len();
    let shape = kv_shape(info, 1, total, 5);
    let one_resident = common::auto_one_resident(info, total, 5);
    let cases = [
        ("full", PolicyOptions::default()),
        ("auto", PolicyOptions::default()),
        ("auto", one_resident),
        ("layer", PolicyOptions::default()),
        ("headwise", PolicyOptions::default()),
        ("headwise:1", disk(None)),
        ("layer", disk(Some(layer * info.n_layers as u64 / 2))),
    ];
    for (policy, opts) in cases {
        let mut p = build_policy(policy, &opts)?;
        p.prepare(&shape)?;
        restore(p.as_mut(), steps)?;
        assert_eq!(p.seq_len(), prompt.len(), "{policy}");
        let got = decode_logits(model, p.as_mut(), prompt.len(), &decode)?;
        let diff = common::max_abs_diff(&got, &want)?;
        assert!(diff <= 1e-5, "{policy} {:?}: {diff}", opts.host_kv_budget);
        if opts.device_kv_budget.is_some() {
            let s = p.stats();
            let units = |m| common::metric(&s, m);
            assert_eq!(
                (units("resident_units"), units("streamed_units")),
                (1, info.n_layers as u64 - 1),
                "{policy}: one unit resident"
            );
        }
        if opts.disk_dir.is_some() {
            assert!(p.stats().disk_kv_bytes > 0, "{policy}: nothing on disk");
        }
    }
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 0);

    for policy in ["recompute", "hybrid"] {
        let mut p = build_policy(policy, &PolicyOptions::default())?;
        match restore(p.as_mut(), steps) {
            Err(KvError::Unsupported(m)) => assert!(m.contains("append_kv"), "{m}"),
            other => anyhow::bail!("{policy}: expected Unsupported, got {other:?}"),
        }
    }
    Ok(())
}
