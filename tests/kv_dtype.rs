//! `kv_dtype` (`--kv-dtype`, LOSSY and opt-in): K/V stored as f16 or bf16 on every tier.
//! `full`'s device buffers hold exactly half of f32's bytes; `layer`, `headwise` and `auto`
//! store the same values (host tier and device buffers) and give `full`'s logits under the
//! same dtype (≤ 1e-5); each stays within its own measured tolerance of the f32 logits
//! while differing from them; f32 itself is lossless; q8_0 is refused by `full`.
mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::core::KvCodec;
use kvpolicy::{
    attend_partial, build_policy, AttnInputs, AttnSpec, CausalLm, KvStats, PolicyOptions,
};

/// Twice the largest |Δ logit| against f32 measured when this test was written, over the
/// HF fixtures (printed with `--nocapture`; both on `llama_mha`): f16 1.354e-2, bf16
/// 1.113e-1 — the host tier's f16/bf16 spread (tests/compressed.rs), as expected of the
/// same rounding.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 2.7e-2,
        _ => 2.3e-1,
    }
}

/// Teacher-forced logits of `policy` storing K/V as `codec`, with its final stats.
fn run(
    model: &dyn CausalLm,
    (prompt, decode): (&[u32], &[u32]),
    policy: &str,
    codec: KvCodec,
) -> Result<(Tensor, KvStats)> {
    let opts = PolicyOptions {
        grow_tokens: 4,
        kv_dtype: codec,
        ..PolicyOptions::default()
    };
    let mut p = build_policy(policy, &opts)?;
    let got = common::teacher_forced_logits(model, p.as_mut(), prompt, decode, 5)?;
    Ok((got, p.stats()))
}

#[test]
fn half_caches_are_labeled_lossy_and_every_policy_agrees_under_them() -> Result<()> {
    for name in common::hf_fixtures() {
        let loaded = common::load_fixture(&name)?;
        let model = loaded.model.as_ref();
        let (prompt, decode) = common::fixture_ids(&name)?;
        let ids = (prompt.as_slice(), decode.as_slice());
        let (exact, exact_stats) = run(model, ids, "full", KvCodec::Model)?;
        // f32 on an f32 model: the same numbers, not lossy.
        let (f32s, st) = run(model, ids, "full", KvCodec::Float(DType::F32))?;
        assert_eq!(common::max_abs_diff(&f32s, &exact)?, 0.0, "{name} f32");
        assert!(!st.lossy && !exact_stats.lossy, "{name}: f32 labeled lossy");
        for dt in [DType::F16, DType::BF16] {
            let codec = KvCodec::Float(dt);
            let (full, st) = run(model, ids, "full", codec)?;
            let d = common::max_abs_diff(&full, &exact)?;
            println!("{name} {dt:?}: max |Δ logit| vs f32 = {d:.3e}");
            assert!(d > 0.0, "{name} {dt:?}: no deviation at all");
            assert!(d <= tolerance(dt), "{name} {dt:?}: {d}");
            assert!(st.lossy, "{name} {dt:?}: not labeled lossy");
            assert_eq!(
                2 * st.device_kv_bytes,
                exact_stats.device_kv_bytes,
                "{name} {dt:?}: device bytes"
            );
            for policy in ["layer", "headwise:group=1", "auto"] {
                let (got, st) = run(model, ids, policy, codec)?;
                let d = common::max_abs_diff(&got, &full)?;
                assert!(d <= 1e-5, "{name} {policy} {dt:?}: {d} from full's");
                assert!(st.lossy, "{name} {policy} {dt:?}: not labeled lossy");
                // Streaming buffers and resident units in the stored dtype, read in place:
                // half of f32's device bytes, nothing charged for an expanded copy.
                let (_, f32_stats) = run(model, ids, policy, KvCodec::Model)?;
                assert_eq!(
                    2 * st.device_kv_peak_bytes,
                    f32_stats.device_kv_peak_bytes,
                    "{name} {policy} {dt:?}: device bytes"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn full_refuses_a_q8_0_cache_naming_where_it_is_stored() -> Result<()> {
    let opts = PolicyOptions {
        kv_dtype: KvCodec::Q8_0,
        ..PolicyOptions::default()
    };
    let e = build_policy("full", &opts).err().map(|e| e.to_string());
    assert!(
        e.as_deref().unwrap_or("").contains("host tier only"),
        "{e:?}"
    );
    // The offload policies store it on the host tier.
    assert!(build_policy("headwise", &opts).is_ok());
    Ok(())
}

#[test]
fn the_kernel_reads_half_keys_as_their_f32_values() -> Result<()> {
    // f32 queries over f16/bf16 K/V equal f32 queries over the same values widened.
    let dev = Device::Cpu;
    let mut spec = AttnSpec::new(6, 2, 64);
    spec.sliding_window = Some(300);
    for (t, s) in [(1usize, 700usize), (37, 400)] {
        let q = Tensor::randn(0f32, 1.0, (1, 6, t, 64), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (1, 2, s, 64), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (1, 2, s, 64), &dev)?;
        for dt in [DType::F16, DType::BF16] {
            let (kh, vh) = (k.to_dtype(dt)?, v.to_dtype(dt)?);
            let (kw, vw) = (kh.to_dtype(DType::F32)?, vh.to_dtype(DType::F32)?);
            let at = |k: &Tensor, v: &Tensor| {
                attend_partial(
                    AttnInputs {
                        q: &q,
                        k,
                        v,
                        q_pos: s - t,
                        k_pos: 0,
                    },
                    &spec,
                )
            };
            let (half, wide) = (at(&kh, &vh)?, at(&kw, &vw)?);
            let d = common::max_abs_diff(&half.out, &wide.out)?;
            assert!(d <= 1e-6, "t {t} s {s} {dt:?}: {d}");
            assert!(common::max_abs_diff(&half.lse, &wide.lse)? <= 1e-5);
        }
    }
    Ok(())
}
