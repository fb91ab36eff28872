//! The default GGUF model against llama.cpp (`scripts/make_llamacpp_refs.py`):
//! tokenization is identical, and greedy decoding follows llama.cpp's.
//!
//! Greedy agreement has a limit that no implementation can remove: SmolLM2's Q4_1 matmuls
//! quantize activations to Q8_1, so a one-ulp difference in a reduction order can move a
//! logit by ~0.1, and where llama.cpp's two best tokens are closer than that, either
//! implementation may pick either one — after which free-running sequences part. So this
//! checks, on every prompt, (1) teacher-forced along llama.cpp's sequence, that we choose
//! llama.cpp's token at each of the first 32 steps, except at most one step where the two
//! candidates are within `NEAR_TIE` logits of each other in our model, and (2) on the first
//! prompt, that free-running greedy equals llama.cpp's for 32 tokens or parts from it
//! exactly at such a near tie (seen: the attention's summation order alone moves step 14
//! of the first prompt, a 0.007-logit tie, from one side to the other).
mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device, IndexOp};
use kvpolicy::models::source::ModelFiles;
use kvpolicy::models::{generate, load, GenerateConfig};
use kvpolicy::{build_policy, PolicyOptions};

const STEPS: usize = 32;
const NEAR_TIE: f32 = 0.05;

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
    for (n, g) in greedy.iter().enumerate() {
        let prompt = common::ids_of(&g["prompt_ids"])?;
        let want = common::ids_of(&g["generated_ids"])?;
        assert!(want.len() >= STEPS);

        // Free-running greedy.
        let mut policy = build_policy("full", &PolicyOptions::default())?;
        let cfg = GenerateConfig {
            max_new_tokens: STEPS,
            stop_at_eos: false,
            ..GenerateConfig::default()
        };
        let got = generate(model, policy.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?.generated_ids;
        let agree = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        println!("prompt {n}: free-running greedy equals llama.cpp for {agree} of {STEPS} tokens");

        // Teacher-forced along llama.cpp's sequence.
        let mut policy = build_policy("full", &PolicyOptions::default())?;
        let cfg = GenerateConfig {
            decode_ids: Some(want[..STEPS - 1].to_vec()),
            collect_logits: true,
            ..GenerateConfig::default()
        };
        let gen = generate(model, policy.as_mut(), &prompt, &cfg, &mut |_| Ok(()))?;
        let logits = gen.logits.context("logits")?;
        let mut near_ties = Vec::new();
        for (i, &tok) in want.iter().take(STEPS).enumerate() {
            let row = logits.i(prompt.len() - 1 + i)?.to_vec1::<f32>()?;
            let (best, best_v) =
                row.iter().enumerate().fold(
                    (0, f32::MIN),
                    |acc, (j, &v)| if v > acc.1 { (j, v) } else { acc },
                );
            if best as u32 != tok {
                let gap = best_v - row[tok as usize];
                assert!(
                    gap < NEAR_TIE,
                    "prompt {n} step {i}: we prefer {best} over llama.cpp's {tok} by {gap} logits"
                );
                near_ties.push((i, gap));
            }
        }
        println!("prompt {n}: teacher-forced, near-tie disagreements (step, gap): {near_ties:?}");
        assert!(
            near_ties.len() <= 1,
            "prompt {n}: too many disagreements {near_ties:?}"
        );
        if n == 0 && agree < STEPS {
            assert!(
                near_ties.iter().any(|&(i, _)| i == agree),
                "prompt 0: free-running greedy parts from llama.cpp at step {agree}, which is not a near tie ({near_ties:?})"
            );
        }
    }
    Ok(())
}
