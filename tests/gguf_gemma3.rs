//! Gemma 3 270M (GGUF, SentencePiece vocabulary, 5 local layers of window 512 to 1 global)
//! against llama.cpp (`scripts/make_gemma3_refs.py`): tokenization is identical, greedy
//! decoding follows llama.cpp's, a needle ~3K tokens back — far outside every local window —
//! is found alike under every policy, and the offload policies move only each local layer's
//! window.
//!
//! Greedy agreement is checked teacher-forced along llama.cpp's sequence: at every step we
//! choose llama.cpp's token, or the step is a tie llama.cpp itself does not decide stably —
//! our margin for its token (minus our gap) is within `spread` of llama.cpp's margin, where
//! `spread` is how far llama.cpp's own margins move when its KV cache goes from f16 to f32
//! (recorded by the script; `common::assert_within_spread`), kept under `MAX_SPREAD`.
mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use kvpolicy::models::load::source::ModelFiles;
use kvpolicy::models::{generate, load, GenerateConfig, Loaded};
use kvpolicy::{build_policy, AttnSpec, HeadGroup, PolicyOptions};

/// The widest llama.cpp spread the test accepts as an anchor (see the module docs).
const MAX_SPREAD: f32 = 1.0;

fn gemma3() -> Result<Loaded> {
    Ok(load(
        &ModelFiles::Gguf(common::gemma3_gguf()?),
        &Device::Cpu,
        DType::F32,
        None,
    )?)
}

/// The reference run called `name`.
fn run_named<'a>(refs: &'a serde_json::Value, name: &str) -> Result<&'a serde_json::Value> {
    refs["greedy"]
        .as_array()
        .context("greedy")?
        .iter()
        .find(|g| g["name"] == name)
        .with_context(|| format!("no reference run {name}"))
}

#[test]
fn tokenization_equals_llamacpp() -> Result<()> {
    let loaded = gemma3()?;
    let tok = loaded.tokenizer.context("GGUF tokenizer")?;
    let refs = common::gemma3_refs()?;
    common::assert_tokenizations(&tok, &refs, 6)?;
    // The prompts of the greedy runs too (the needle prompts are thousands of tokens).
    for g in refs["greedy"].as_array().context("greedy")? {
        let text = g["prompt"].as_str().context("prompt")?;
        let want = common::ids_of(&g["prompt_ids"])?;
        assert_eq!(tok.encode(text)?, want, "tokenization of {}", g["name"]);
    }
    Ok(())
}

#[test]
fn greedy_follows_llamacpp() -> Result<()> {
    let loaded = gemma3()?;
    let refs = common::gemma3_refs()?;
    let runs = refs["greedy"].as_array().context("greedy")?;
    let spread = common::anchored_spread(runs, usize::MAX, MAX_SPREAD)?;
    for name in ["short", "chat", "needle_3k"] {
        let g = run_named(&refs, name)?;
        let prompt = common::ids_of(&g["prompt_ids"])?;
        let want = common::ids_of(&g["generated_ids"])?;
        let gaps = common::greedy_gaps(loaded.model.as_ref(), &prompt, &want)?;
        let off = common::disagreements(&gaps);
        println!(
            "{name}: we choose llama.cpp's token at {} of {} steps; elsewhere the gaps are {off:?}",
            gaps.len() - off.len(),
            gaps.len()
        );
        let margins: Vec<f32> = serde_json::from_value(g["margins"].clone())?;
        common::assert_within_spread(name, &gaps, &margins, spread);
    }
    Ok(())
}

/// Host→device bytes that `layer`/`headwise` must move for a run with steps at `positions`:
/// each layer's history inside its window, K and V, f32.
fn windowed_h2d(positions: &[usize], loaded: &Loaded) -> u64 {
    let info = loaded.model.info();
    let mut total = 0u64;
    for &p in positions {
        for i in 0..info.n_layers {
            let mut spec = AttnSpec::new(info.n_heads, info.n_kv_heads, info.head_dim);
            // Gemma 3: five local layers (window 512), then one global.
            spec.sliding_window = ((i + 1) % 6 != 0).then_some(512);
            let tokens = p - spec.window_start(p);
            total += (tokens * info.n_kv_heads * info.head_dim * 4 * 2) as u64;
        }
    }
    total
}

#[test]
fn the_needle_is_found_alike_under_every_policy() -> Result<()> {
    let loaded = gemma3()?;
    let tok = loaded.tokenizer.as_ref().context("tokenizer")?;
    let refs = common::gemma3_refs()?;
    let needle = run_named(&refs, "needle_3k")?;
    let prompt = common::ids_of(&needle["prompt_ids"])?;
    let answer = " tangerine-harbor-42";
    let chunk = 2048;
    let new = 8;
    let cfg = GenerateConfig {
        prefill_chunk: chunk,
        max_new_tokens: new,
        stop_at_eos: false,
        ..GenerateConfig::default()
    };
    // Steps: the prefill chunks, then a decode step per token after the first.
    let mut positions: Vec<usize> = (0..prompt.len()).step_by(chunk).collect();
    positions.extend(prompt.len()..prompt.len() + new - 1);
    let mut first: Option<Vec<u32>> = None;
    for (name, group) in [
        ("full", HeadGroup::Auto),
        ("layer", HeadGroup::Auto),
        ("headwise", HeadGroup::Fixed(1)),
        ("recompute", HeadGroup::Auto),
        ("hybrid", HeadGroup::Auto),
    ] {
        let mut policy = build_policy(&common::spec(name, group), &PolicyOptions::default())?;
        let gen = generate(
            loaded.model.as_ref(),
            policy.as_mut(),
            &prompt,
            &cfg,
            &mut |_| Ok(()),
        )?;
        let text = tok.decode(&gen.generated_ids)?;
        println!("{name}: {text:?}");
        assert!(text.starts_with(answer), "{name} answered {text:?}");
        match &first {
            None => first = Some(gen.generated_ids.clone()),
            Some(ids) => assert_eq!(&gen.generated_ids, ids, "{name} differs from full"),
        }
        if name == "layer" || name == "headwise" {
            assert_eq!(
                policy.stats().h2d_bytes,
                windowed_h2d(&positions, &loaded),
                "{name}: host→device bytes are not each layer's window"
            );
        }
    }
    // The LOSSY compressed host tier is held to the answer, not to `full`'s exact ids.
    use kvpolicy::core::KvCodec;
    for codec in [
        KvCodec::Float(candle_core::DType::F16),
        KvCodec::Float(candle_core::DType::BF16),
        KvCodec::Q8_0,
    ] {
        let opts = PolicyOptions {
            host_kv_dtype: codec,
            ..PolicyOptions::default()
        };
        let mut policy = build_policy("headwise:1", &opts)?;
        let gen = generate(
            loaded.model.as_ref(),
            policy.as_mut(),
            &prompt,
            &cfg,
            &mut |_| Ok(()),
        )?;
        let text = tok.decode(&gen.generated_ids)?;
        println!("headwise, host K/V {codec:?} (lossy): {text:?}");
        assert!(policy.stats().lossy);
        assert!(text.starts_with(answer), "{codec:?} answered {text:?}");
    }
    Ok(())
}
