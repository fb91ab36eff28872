//! Every HF reference fixture, under `full`: teacher-forced logits equal HF transformers'
//! (max abs diff ≤ 1e-4, f32) for single-pass and chunked prefill and the decode steps.
mod common;

use anyhow::Result;
use candle_core::Tensor;
use kvpolicy::models::{generate, GenerateConfig};
use kvpolicy::{build_policy, PolicyOptions};

const TOL: f32 = 1e-4;

fn run(name: &str, chunk: usize) -> Result<f32> {
    let loaded = common::load_fixture(name)?;
    let (prompt, decode) = common::fixture_ids(name)?;
    let mut policy = build_policy("full", &PolicyOptions::default())?;
    let cfg = GenerateConfig {
        prefill_chunk: chunk,
        decode_ids: Some(decode),
        collect_logits: true,
        ..GenerateConfig::default()
    };
    let gen = generate(
        loaded.model.as_ref(),
        policy.as_mut(),
        &prompt,
        &cfg,
        &mut |_| Ok(()),
    )?;
    let got = gen
        .logits
        .ok_or_else(|| anyhow::anyhow!("no logits collected"))?;
    let want = common::fixture_logits(name)?;
    assert_eq!(got.dims(), want.dims(), "{name}: logits shape");
    common::max_abs_diff(&got, &want)
}

#[test]
fn full_matches_hf_single_pass_and_chunked() -> Result<()> {
    let names = common::hf_fixtures();
    assert!(names.len() >= 2, "fixtures missing: {names:?}");
    for name in &names {
        for chunk in [0, 1, 5, 16] {
            let d = run(name, chunk)?;
            println!("{name} chunk {chunk}: max |Δ| = {d:.2e}");
            assert!(d <= TOL, "{name} chunk {chunk}: max |Δlogit| = {d}");
        }
    }
    Ok(())
}

#[test]
fn fixtures_are_sensitive_to_position() -> Result<()> {
    // A sanity check of the reference itself: logits vary strongly across rows.
    let want = common::fixture_logits("llama_gqa")?;
    let a = want.get(3)?;
    let b = want.get(4)?;
    assert!(common::max_abs_diff(&a, &b)? > 1.0);
    let _ = Tensor::zeros(1, candle_core::DType::F32, &candle_core::Device::Cpu)?;
    Ok(())
}
