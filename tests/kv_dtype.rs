//! `kv_dtype` (`--kv-dtype`, LOSSY and opt-in): K/V stored as f16, bf16 or q8_0 on every
//! tier. `full`'s device buffers hold exactly half (q8_0: 34/128) of f32's bytes; `layer`,
//! `headwise` and `auto` store the same values (host tier and device buffers) and give
//! `full`'s logits under the same dtype (≤ 1e-5); each stays within its own measured
//! tolerance of the f32 logits while differing from them; f32 itself is lossless.
mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::core::KvCodec;
use kvpolicy::models::engine::generate::kv_shape;
use kvpolicy::models::{load, resolve, ModelSpec};
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

/// Twice the largest |Δ logit| of q8_0 against f32 measured when this test was written
/// (printed with `--nocapture`): 5.40e-3 on both random models below (the host tier alone
/// as q8_0 moved the head-width-32 llama of tests/compressed.rs by 2.5e-3; here the prompt's
/// K/V are stored as q8_0 too).
const Q8_TOLERANCE: f32 = 1.1e-2;

/// A random-weight model of `config` (head width 32: whole q8_0 blocks, which none of the
/// HF fixtures has).
fn random_model(dir: &std::path::Path, config: serde_json::Value) -> Result<Box<dyn CausalLm>> {
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, serde_json::to_string(&config)?)?;
    let files = resolve(&ModelSpec::Random {
        config: cfg,
        seed: 5,
    })?;
    Ok(load(&files, &Device::Cpu, DType::F32, None)?.model)
}

#[test]
fn q8_0_caches_hold_34_of_128_bytes_and_every_policy_agrees_under_them() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let base = serde_json::json!({
        "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
        "rope_theta": 10000.0
    });
    let with = |extra: serde_json::Value| {
        let mut c = base.clone();
        for (k, v) in extra.as_object().into_iter().flatten() {
            c[k] = v.clone();
        }
        c
    };
    let ids: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % 256).collect();
    let (prompt, decode) = ids.split_at(24);
    for (name, config) in [
        ("llama", with(serde_json::json!({"model_type": "llama"}))),
        (
            "mistral window 8",
            with(serde_json::json!({"model_type": "mistral", "sliding_window": 8})),
        ),
    ] {
        let model = random_model(dir.path(), config)?;
        let model = model.as_ref();
        let (exact, exact_stats) = run(model, (prompt, decode), "full", KvCodec::Model)?;
        let (full, st) = run(model, (prompt, decode), "full", KvCodec::Q8_0)?;
        let d = common::max_abs_diff(&full, &exact)?;
        println!("random {name} q8_0: max |Δ logit| vs f32 = {d:.3e}");
        assert!(d > 0.0 && d <= Q8_TOLERANCE, "{name}: {d}");
        assert!(st.lossy, "{name}: not labeled lossy");
        assert_eq!(
            128 * st.device_kv_bytes,
            34 * exact_stats.device_kv_bytes,
            "{name}: device bytes"
        );
        for policy in ["layer", "headwise:group=1", "auto"] {
            let (got, st) = run(model, (prompt, decode), policy, KvCodec::Q8_0)?;
            let d = common::max_abs_diff(&got, &full)?;
            assert!(d <= 1e-5, "{name} {policy}: {d} from full's");
            assert!(st.lossy, "{name} {policy}: not labeled lossy");
            let (_, f32_stats) = run(model, (prompt, decode), policy, KvCodec::Model)?;
            assert_eq!(
                128 * st.device_kv_peak_bytes,
                34 * f32_stats.device_kv_peak_bytes,
                "{name} {policy}: device bytes"
            );
        }
        // `auto` planned for 6 tokens meets the longer run under budgets from no resident
        // unit to all: growing streaming buffers demote resident units to the host tier,
        // which takes their blocks as they are (never quantized twice), so every placement
        // gives `full`'s logits.
        let (chunk, grow) = (3, 2);
        let info = model.info().clone();
        let opts = |budget: Option<u64>| PolicyOptions {
            grow_tokens: grow,
            kv_dtype: KvCodec::Q8_0,
            device_kv_budget: budget,
            ..PolicyOptions::default()
        };
        let want = common::short_plan_logits(
            model,
            build_policy("full", &opts(None))?.as_mut(),
            prompt,
            decode,
        )?;
        let total = prompt.len() + decode.len();
        let model_shape = kv_shape(&info, 1, total, chunk);
        let shape = model_shape.stored_as(KvCodec::Q8_0);
        let cap = total.div_ceil(grow) * grow;
        let small = shape.kv_bytes(1, 6usize.div_ceil(grow) * grow);
        let reading = kvpolicy::KvShape {
            dtype: DType::U8,
            ..model_shape
        };
        let streaming =
            2 * shape.kv_bytes(1, cap) + reading.step_scratch_bytes(1, cap, &Device::Cpu);
        let mut demoted = 0;
        for k in 0..=(info.n_layers * info.n_kv_heads) as u64 {
            let mut p = build_policy("auto", &opts(Some(streaming + k * small)))?;
            let got = common::short_plan_logits(model, p.as_mut(), prompt, decode)?;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let d = common::max_abs_diff(g, w)?;
                assert!(
                    d <= 1e-5,
                    "{name} auto, {k} units' room, step {i}: {d} from full's"
                );
            }
            demoted += common::metric(&p.stats(), "demotions");
        }
        println!("random {name}: {demoted} demotions over the budgets");
        // Every mistral layer keeps a window's buffer: nothing grows, nothing is demoted.
        let global = info.windows.iter().any(Option::is_none);
        assert!(!global || demoted > 0, "{name}: no budget demoted a unit");
        assert!(
            global || info.windows.iter().all(|w| *w == Some(8)),
            "{name}"
        );
    }
    Ok(())
}

/// `helix` over q8_0 shares (ranks as threads): each rank stores its share's tokens as the
/// same blocks `full` would (rows are quantized one by one), so every rank's logits equal
/// `full`'s under q8_0 — `auto` locals included, whose ranks attend an empty resident view
/// before their share begins (that partial has the queries' width, not the blocks' bytes).
#[test]
fn helix_shares_stored_as_q8_0_give_fulls_logits() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let ids: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % 256).collect();
    let (prompt, decode) = ids.split_at(24);
    // With an 8-token window the first ranks' shares fall before every later window.
    for (arch, window) in [("llama", None), ("mistral", Some(8))] {
        let config = serde_json::json!({
            "model_type": arch, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 256, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
            "rope_theta": 10000.0, "sliding_window": window
        });
        let model = random_model(dir.path(), config)?;
        let (want, _) = run(model.as_ref(), (prompt, decode), "full", KvCodec::Q8_0)?;
        let model: std::sync::Arc<dyn CausalLm> = std::sync::Arc::from(model);
        helix_ranks(&model, (prompt, decode), &want, arch)?;
    }
    Ok(())
}

/// Every rank of `helix` over 3 threads, locals `full` and `auto` storing q8_0, against
/// `want`.
fn helix_ranks(
    model: &std::sync::Arc<dyn CausalLm>,
    (prompt, decode): (&[u32], &[u32]),
    want: &Tensor,
    arch: &str,
) -> Result<()> {
    use kvpolicy::helix::{HelixPolicy, ThreadGroup};
    for local in ["full", "auto"] {
        let handles: Vec<_> = ThreadGroup::new(3)
            .into_iter()
            .map(|group| {
                let (model, prompt, decode) = (model.clone(), prompt.to_vec(), decode.to_vec());
                std::thread::spawn(move || -> Result<Tensor> {
                    let opts = PolicyOptions {
                        grow_tokens: 4,
                        kv_dtype: KvCodec::Q8_0,
                        ..PolicyOptions::default()
                    };
                    let inner = build_policy(local, &opts)?;
                    let mut p = HelixPolicy::new(inner, std::sync::Arc::new(group))?;
                    common::teacher_forced_logits(model.as_ref(), &mut p, &prompt, &decode, 5)
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let got = h
                .join()
                .map_err(|_| anyhow::anyhow!("rank {r} panicked"))??;
            let d = common::max_abs_diff(&got, want)?;
            assert!(d <= 1e-5, "{arch} helix:{local} rank {r}: {d} from full's");
        }
    }
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

#[test]
fn the_runner_labels_kv_dtype_lossy_and_refuses_what_a_policy_cannot_store() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fixture = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let base = [
        "--model-dir",
        fixture.as_str(),
        "--prompt-ids",
        "1,2,3,4,5",
        "--max-new-tokens",
        "3",
    ];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        [base, extra].concat()
    }
    let llama = |extra: &[&str]| common::cli::llama(&with(&base, extra));
    let stats = |name: &str| dir.path().join(name).to_string_lossy().into_owned();
    let lossy = |path: &str| -> Result<bool> {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        v["lossy"]
            .as_bool()
            .ok_or_else(|| anyhow::anyhow!("no `lossy` in {v}"))
    };
    // f16 under full and headwise: the summary and --stats-out say LOSSY, naming the flag.
    for policy in ["full", "headwise"] {
        let out = stats(&format!("{policy}-f16.json"));
        let o = llama(&["--policy", policy, "--kv-dtype", "f16", "--stats-out", &out])?;
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{policy}: {err}");
        assert!(
            err.contains("LOSSY: K/V stored in the smaller --kv-dtype"),
            "{policy}: {err}"
        );
        assert!(lossy(&out)?, "{policy}: --stats-out not lossy");
    }
    // f32 is the model's own: not lossy, no label.
    let out = stats("full-f32.json");
    let o = llama(&["--kv-dtype", "f32", "--stats-out", &out])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !err.contains("LOSSY"), "{err}");
    assert!(!lossy(&out)?);
    // q8_0 on heads 16 wide (not whole blocks): refused, naming the width and what to do.
    common::cli::fails_with(
        &with(&base, &["--policy", "full", "--kv-dtype", "q8_0"]),
        "multiple of 32, not 16",
    )?;
    // An unknown form: the flag's values.
    common::cli::fails_with(
        &with(&base, &["--kv-dtype", "f8"]),
        "`f8`: use f32, f16, bf16 or q8_0",
    )?;
    // A policy that does not read it: warned, ignored, not labeled lossy.
    let o = llama(&["--policy", "recompute", "--kv-dtype", "f16"])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success()
            && err.contains("--kv-dtype does not apply to the `recompute` policy")
            && !err.contains("LOSSY"),
        "{err}"
    );
    Ok(())
}
