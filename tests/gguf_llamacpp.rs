//! The default GGUF model against llama.cpp (`scripts/make_llamacpp_refs.py`):
//! tokenization is identical, and greedy decoding follows llama.cpp's.
//!
//! Greedy agreement has a limit that no implementation removes: SmolLM2's Q4_1 matmuls
//! quantize activations to Q8_1, so a one-ulp difference in a reduction order can move a
//! logit by ~0.1, and where the two best tokens are that close either may win. llama.cpp
//! itself does not decide such ties stably: with its KV cache in f32 instead of f16, its
//! margins along its own greedy ids (its logit of the chosen token minus its best other
//! logit, recorded by the script) move by up to `spread` (0.69 logits when measured), and
//! its greedy continuations part from its own after 5, 10 and 15 tokens. So the tolerance
//! is measured, not chosen: teacher-forced along llama.cpp's sequence we choose its token
//! at every step, or our margin for its token (minus our gap) is within `spread` of
//! llama.cpp's margin (`common::assert_within_spread`; `spread` kept under `MAX_SPREAD`);
//! and free-running greedy on the first prompt equals llama.cpp's up to the first such step.
mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use kvpolicy::models::load::source::ModelFiles;
use kvpolicy::models::{generate, load, GenerateConfig};
use kvpolicy::{build_policy, PolicyOptions};

const STEPS: usize = 32;
/// The widest llama.cpp spread the test accepts as an anchor (see the module docs).
const MAX_SPREAD: f32 = 1.0;

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
    let spread = common::anchored_spread(greedy, STEPS, MAX_SPREAD)?;
    for (n, g) in greedy.iter().enumerate() {
        let prompt = common::ids_of(&g["prompt_ids"])?;
        let want = common::ids_of(&g["generated_ids"])?;
        assert!(want.len() >= STEPS);
        let gaps = common::greedy_gaps(model, &prompt, &want[..STEPS])?;
        let off = common::disagreements(&gaps);
        println!("prompt {n}: teacher-forced, we choose llama.cpp's token at {} of {STEPS} steps; elsewhere the gaps are {off:?}", STEPS - off.len());
        let margins: Vec<f32> = serde_json::from_value(g["margins"].clone())?;
        common::assert_within_spread(&format!("prompt {n}"), &gaps, &margins, spread);
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
