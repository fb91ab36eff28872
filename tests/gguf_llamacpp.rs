//! The default GGUF model against llama.cpp (`scripts/make_llamacpp_refs.py`):
//! tokenization is identical, and greedy decoding follows llama.cpp's.
//!
//! Greedy agreement has a limit that no implementation removes: SmolLM2's Q4_1 matmuls
//! quantize activations to Q8_1, so a one-ulp difference in a reduction order can move a
//! logit by ~0.1, and where the two best tokens are closer than that either may win.
//! llama.cpp itself does not decide such ties stably: with its KV cache in f32 instead of
//! f16 its greedy continuations part from its own after 5, 10 and 15 tokens (both runs are
//! in the references). So the width of a near tie is measured, not chosen: at each step
//! where llama.cpp's two runs part, the gap in our logits between its two tokens; the
//! widest is the tolerance `w` (kept under `MAX_TIE`). Teacher-forced along llama.cpp's
//! sequence we choose its token at every step, or its token is within `w` of ours; and
//! free-running greedy on the first prompt equals llama.cpp's up to the first such step.
mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use kvpolicy::models::source::ModelFiles;
use kvpolicy::models::{generate, load, GenerateConfig};
use kvpolicy::{build_policy, PolicyOptions};

const STEPS: usize = 32;
/// The widest near tie the test accepts as an anchor (see the module docs).
const MAX_TIE: f32 = 0.5;

#[test]
fn tokenization_equals_llamacpp() -> Result<()> {
    let path = common::default_gguf()?;
    let loaded = load(&ModelFiles::Gguf(path), &Device::Cpu, DType::F32, None)?;
    let tok = loaded.tokenizer.context("GGUF tokenizer")?;
    let refs = common::llamacpp_refs()?;
    common::assert_tokenizations(&tok, &refs, 5)
}

#[test]
fn greedy_follows_llamacpp() -> Result<()> {
    let path = common::default_gguf()?;
    let loaded = load(&ModelFiles::Gguf(path), &Device::Cpu, DType::F32, None)?;
    let model = loaded.model.as_ref();
    let refs = common::llamacpp_refs()?;
    let greedy = refs["greedy"].as_array().context("greedy")?;
    // llama.cpp's own spread: where its f16-KV and f32-KV runs part, how far apart the two
    // tokens are for us.
    let mut tie = 0f32;
    for (n, g) in greedy.iter().enumerate() {
        let prompt = common::ids_of(&g["prompt_ids"])?;
        let f16 = common::ids_of(&g["generated_ids"])?;
        let f32 = common::ids_of(&g["f32_kv_generated_ids"])?;
        let Some(part) = f16.iter().zip(&f32).position(|(a, b)| a != b) else {
            continue;
        };
        let a = common::greedy_gaps(model, &prompt, &f16[..=part])?[part];
        let b = common::greedy_gaps(model, &prompt, &f32[..=part])?[part];
        println!(
            "prompt {n}: llama.cpp's f16/f32 KV runs part at step {part}: our gaps {a} and {b}"
        );
        tie = tie.max(a.max(b));
    }
    assert!(
        tie > 0.0,
        "llama.cpp's f16 and f32 KV runs never part; the tolerance has no anchor"
    );
    assert!(
        tie <= MAX_TIE,
        "llama.cpp's own split is {tie} logits wide for us"
    );
    for (n, g) in greedy.iter().enumerate() {
        let prompt = common::ids_of(&g["prompt_ids"])?;
        let want = common::ids_of(&g["generated_ids"])?;
        assert!(want.len() >= STEPS);
        let gaps = common::greedy_gaps(model, &prompt, &want[..STEPS])?;
        let off: Vec<(usize, f32)> = gaps
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, g)| *g > 0.0)
            .collect();
        println!("prompt {n}: teacher-forced, we choose llama.cpp's token at {} of {STEPS} steps; elsewhere the gaps are {off:?}", STEPS - off.len());
        for &(i, gap) in &off {
            assert!(
                gap <= tie,
                "prompt {n} step {i}: llama.cpp's token is {gap} logits below ours (near-tie width {tie})"
            );
        }
        if n == 0 {
            let mut policy = build_policy("full", &PolicyOptions::default())?;
            let cfg = GenerateConfig {
                max_new_tokens: STEPS,
                stop_at_eos: false,
                ..GenerateConfig::default()
            };
            let got =
                generate(model, policy.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?.generated_ids;
            let agree = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            println!(
                "prompt 0: free-running greedy equals llama.cpp for {agree} of {STEPS} tokens"
            );
            assert!(
                agree == STEPS || off.iter().any(|&(i, _)| i == agree),
                "prompt 0: free-running greedy parts from llama.cpp at step {agree}, which is not a near tie ({off:?})"
            );
        }
    }
    Ok(())
}
