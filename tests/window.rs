//! Policies driven directly with random attention steps (no model): sliding-window
//! attention through chunked prefill and decode equals `full`, and offload policies move only
//! the window's range host→device.
use anyhow::Result;
use candle_core::{Device, Tensor};
use kvpolicy::{build_policy, AttnSpec, AttnStep, HeadGroup, KvPolicy, NoRegen, PolicyOptions};

/// Runs `chunks` (token counts) through `layers` layers; returns every step's outputs.
fn drive(
    policy: &mut dyn KvPolicy,
    spec: &AttnSpec,
    layers: usize,
    chunks: &[usize],
    seed: u64,
) -> Result<Vec<Tensor>> {
    let dev = Device::Cpu;
    let d = spec.head_dim;
    let mut outs = Vec::new();
    let mut pos = 0;
    for (i, &t) in chunks.iter().enumerate() {
        for layer in 0..layers {
            // Deterministic pseudo-random data per (step, layer).
            let n = |heads: usize, salt: u64| -> Result<Tensor> {
                let len = heads * t * d;
                let v: Vec<f32> = (0..len)
                    .map(|j| {
                        let x = (j as u64 + 1) * 2654435761
                            + seed * 97
                            + (i as u64) * 7919
                            + layer as u64 * 104729
                            + salt * 15485863;
                        ((x % 20011) as f32 / 20011.0 - 0.5) * 4.0
                    })
                    .collect();
                Ok(Tensor::from_vec(v, (1, heads, t, d), &dev)?)
            };
            let (q, k, v) = (
                n(spec.n_heads, 1)?,
                n(spec.n_kv_heads, 2)?,
                n(spec.n_kv_heads, 3)?,
            );
            let x = Tensor::zeros((1, t, 8), candle_core::DType::F32, &dev)?;
            let step = AttnStep {
                seq: 0,
                layer,
                q: &q,
                k: &k,
                v: &v,
                x: &x,
                pos,
                spec,
                regen: &NoRegen,
            };
            outs.push(policy.attend(&step)?);
        }
        pos += t;
    }
    Ok(outs)
}

#[test]
fn sliding_window_equals_full_and_moves_only_the_window() -> Result<()> {
    let mut spec = AttnSpec::new(6, 3, 8);
    spec.sliding_window = Some(7);
    let chunks = [5, 4, 9, 1, 1, 1, 3, 1, 1];
    let mut full = build_policy("full", &PolicyOptions::default())?;
    let want = drive(full.as_mut(), &spec, 2, &chunks, 1)?;
    for (name, group) in [
        ("layer", HeadGroup::Auto),
        ("headwise", HeadGroup::Fixed(1)),
        ("headwise", HeadGroup::Fixed(3)),
    ] {
        let opts = PolicyOptions {
            grow_tokens: 4,
            ..PolicyOptions::default()
        };
        let mut p = build_policy(&with_group(name, group), &opts)?;
        let got = drive(p.as_mut(), &spec, 2, &chunks, 1)?;
        for (a, b) in got.iter().zip(&want) {
            let d = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(d <= 1e-5, "{name} {group:?}: {d}");
        }
        // Host→device bytes: for each step, the window's history only (not the whole cache).
        let mut pos = 0;
        let mut want_h2d = 0u64;
        for &t in &chunks {
            let start = spec.window_start(pos);
            want_h2d += ((pos - start) * 2 * 3 * 8 * 4 * 2) as u64; // tokens × layers × kv heads × d × f32 × (K,V)
            pos += t;
        }
        assert_eq!(p.stats().h2d_bytes, want_h2d, "{name} {group:?}");
    }
    Ok(())
}

#[test]
fn a_step_at_the_wrong_position_is_an_error() -> Result<()> {
    let spec = AttnSpec::new(2, 1, 4);
    for name in ["full", "layer", "headwise"] {
        let mut p = build_policy(name, &PolicyOptions::default())?;
        drive(p.as_mut(), &spec, 1, &[3], 0)?;
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 2, 1, 4), candle_core::DType::F32, &dev)?;
        let k = Tensor::zeros((1, 1, 1, 4), candle_core::DType::F32, &dev)?;
        let x = Tensor::zeros((1, 1, 8), candle_core::DType::F32, &dev)?;
        let step = AttnStep {
            seq: 0,
            layer: 0,
            q: &q,
            k: &k,
            v: &k,
            x: &x,
            pos: 7,
            spec: &spec,
            regen: &NoRegen,
        };
        let e = p
            .attend(&step)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("holds 3 tokens but the step starts at position 7"),
            "{name}: {e}"
        );
        p.reset();
        assert_eq!(p.seq_len(), 0);
        assert_eq!(p.stats().device_kv_bytes, 0);
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
