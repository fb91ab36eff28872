//! The approximate policies (`quest`, `flexicache`, `clo`; issue 29) on real models, held to
//! their own measured tolerance: on the needle prompt of `scripts/make_gemma3_refs.py`
//! (numbered filler records, a passphrase ~200 tokens from the start, the question at the
//! end: ~3.2K tokens), teacher-forced along `full`'s greedy answer, every policy at its
//! budget (Gemma 3: 256 tokens, SmolLM2: 1024) keeps `full`'s choice at every step — it
//! answers the needle — and its mean and largest KL divergence from `full`'s next-token
//! distribution stay under the bounds below: the values measured on this repository's
//! 2-core CPU (the test prints them), doubled for another CPU's rounding. They are also
//! above zero: at these budgets the policies are approximate, not `full` by another name.
//!
//! Since prefill runs as the integer GEMM (activations quantized to Q8, as decode always
//! did and llama.cpp does), a small change to the cache flips some of the next layers'
//! activation roundings, so the KL moves by up to ~3× with any change in the last bits
//! anywhere (a kernel's summation order, an exp one ulp off): each bound is twice the
//! largest of four measurements — the f32 prefill's and three builds of the GEMM's (its
//! first version, then a vector exp, then Q8_K activations for the K-quants and the exp
//! rounded once from f64: the last is the code here) — listed in that order below.
//!
//! Gemma 3 270M selects only in its 3 global layers (its 15 sliding-window layers keep their
//! windows); SmolLM2-135M selects in all 30.
//!
//! The smaller KV dtypes (`kv_dtype` f16/bf16/q8_0 on every tier; issue 32) are held the
//! same way: exact selection, rounded values.
mod common;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Tensor, D};
use kvpolicy::core::KvCodec;
use kvpolicy::models::{generate, GenerateConfig, Loaded};
use kvpolicy::{build_policy, PolicyOptions};

const F16: KvCodec = KvCodec::Float(DType::F16);
const BF16: KvCodec = KvCodec::Float(DType::BF16);
const EXACT: KvCodec = KvCodec::Model;

/// Greedy answer tokens every policy is teacher-forced along (SmolLM2 spells the
/// passphrase's digits one token each).
const ANSWER: usize = 10;

/// A policy at its tested budget (or KV dtype) and the KL bounds it is held to.
struct Bound {
    spec: &'static str,
    /// How K/V are stored (`kv_dtype`).
    kv: KvCodec,
    /// Mean over the answer's steps of KL(full ‖ policy), nats.
    mean_kl: f32,
    /// The largest step's KL, nats.
    max_kl: f32,
}

/// `full`'s greedy answer and its logits along it, then every bound's policy along the same
/// tokens: same top-1 at every step, KL within the bound and above zero.
fn held_to(loaded: &Loaded, prompt: &[u32], answer: &str, bounds: &[Bound]) -> Result<()> {
    let model = loaded.model.as_ref();
    let tok = loaded.tokenizer.as_ref().context("tokenizer")?;
    let run = |spec: &str, kv: KvCodec, decode: Option<Vec<u32>>| -> Result<_> {
        let opts = PolicyOptions {
            kv_dtype: kv,
            ..PolicyOptions::default()
        };
        let mut policy = build_policy(spec, &opts)?;
        let cfg = GenerateConfig {
            max_new_tokens: ANSWER,
            stop_at_eos: false,
            collect_logits: true,
            decode_logits_only: true,
            decode_ids: decode,
            ..GenerateConfig::default()
        };
        let gen = generate(model, policy.as_mut(), prompt, &cfg, &mut |_| Ok(()))?;
        Ok((gen, policy.stats()))
    };
    let (greedy, _) = run("full", KvCodec::Model, None)?;
    let text = tok.decode(&greedy.generated_ids)?;
    ensure!(text.starts_with(answer), "full answered {text:?}");
    // Teacher-forced along the answer: the rows predicting each of its tokens, as the
    // greedy run computed them.
    let decode = greedy.generated_ids[..ANSWER - 1].to_vec();
    let reference = greedy.logits.context("full's logits")?;
    let mut failures = Vec::new();
    for b in bounds {
        let (gen, stats) = run(b.spec, b.kv, Some(decode.clone()))?;
        let got = gen.logits.context("logits")?;
        ensure!(
            got.dims() == reference.dims(),
            "{:?} vs {:?}",
            got.dims(),
            reference.dims()
        );
        let kl = kl_rows(&reference, &got)?;
        let mean = kl.iter().sum::<f32>() / kl.len() as f32;
        let max = kl.iter().copied().fold(0f32, f32::max);
        let agree = top1(&reference)? == top1(&got)?;
        println!(
            "{} ({:?}): mean KL {mean:.5}, max KL {max:.5} over {} steps, top-1 kept: {agree}, {} bytes moved",
            b.spec,
            b.kv,
            kl.len(),
            stats.h2d_bytes
        );
        if !stats.lossy {
            failures.push(format!("{} is not labeled lossy", b.spec));
        }
        if !agree {
            failures.push(format!("{} leaves full's answer: {kl:?}", b.spec));
        }
        if mean <= 0.0 {
            failures.push(format!("{}: no difference from full at all", b.spec));
        }
        if mean > b.mean_kl || max > b.max_kl {
            failures.push(format!(
                "{}: mean KL {mean} (bound {}), max {max} (bound {})",
                b.spec, b.mean_kl, b.max_kl
            ));
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// KL(p ‖ q) per row of two `(rows, vocab)` logit tensors.
fn kl_rows(p: &Tensor, q: &Tensor) -> Result<Vec<f32>> {
    let lp = candle_nn::ops::log_softmax(&p.to_dtype(DType::F32)?, D::Minus1)?;
    let lq = candle_nn::ops::log_softmax(&q.to_dtype(DType::F32)?, D::Minus1)?;
    let kl = (lp.exp()? * (&lp - &lq)?)?.sum(D::Minus1)?;
    Ok(kl
        .to_vec1::<f32>()?
        .into_iter()
        .map(|k| k.max(0.0))
        .collect())
}

fn top1(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
}

/// The needle prompt's text and ids (Gemma 3's, from llama.cpp's tokenizer).
fn needle() -> Result<(String, Vec<u32>)> {
    let refs = common::gemma3_refs()?;
    let g = refs["greedy"]
        .as_array()
        .context("greedy")?
        .iter()
        .find(|g| g["name"] == "needle_3k")
        .context("no needle_3k reference")?;
    let text = g["prompt"].as_str().context("prompt")?.to_string();
    Ok((text, common::ids_of(&g["prompt_ids"])?))
}

#[test]
fn gemma3_keeps_the_needle_within_its_measured_kl() -> Result<()> {
    let loaded = kvpolicy::models::load(
        &kvpolicy::models::ModelFiles::Gguf(common::gemma3_gguf()?),
        &candle_core::Device::Cpu,
        DType::F32,
        None,
    )?;
    let (_, prompt) = needle()?;
    // Measured, mean / max KL over 10 steps: quest 0.00171 / 0.01022, 0.00166 / 0.00887,
    // 0.00196 / 0.00942, 0.00256 / 0.01503; flexicache 0.01571 / 0.14688, 0.02012 /
    // 0.19269, 0.01491 / 0.13994, 0.01501 / 0.14290; clo as quest; K/V stored as f16
    // 0.00023 / 0.00068, 0.00099 / 0.00620, 0.00054 / 0.00266, 0.00114 / 0.00396; as q8_0
    // on the host tier 0.00037 / 0.00083, 0.00073 / 0.00270, 0.00139 / 0.00921, 0.00046 /
    // 0.00194, then on every tier (the step's own K/V rounded too; `full` and `headwise`
    // alike) 0.00112 / 0.00496.
    held_to(
        &loaded,
        &prompt,
        " tangerine-harbor-42",
        &[
            Bound {
                spec: "quest:budget=256",
                kv: EXACT,
                mean_kl: 0.0052,
                max_kl: 0.031,
            },
            Bound {
                spec: "flexicache:budget=256",
                kv: EXACT,
                mean_kl: 0.041,
                max_kl: 0.39,
            },
            Bound {
                spec: "clo:budget=256",
                kv: EXACT,
                mean_kl: 0.0052,
                max_kl: 0.031,
            },
            Bound {
                spec: "full",
                kv: F16,
                mean_kl: 0.0023,
                max_kl: 0.0124,
            },
            // Every tier stores q8_0 now, under `headwise` as under `full` (the same values:
            // one run), held to the bound of the q8_0 host tier's four builds.
            Bound {
                spec: "full",
                kv: KvCodec::Q8_0,
                mean_kl: 0.0028,
                max_kl: 0.019,
            },
        ],
    )
}

/// SmolLM2 selects in every layer, and this prompt of near-identical records is hard for
/// it: at a budget of 512 (a fifth of the ~2.6K tokens) `quest` and `clo` lose the answer
/// (mean KL 0.28 and 1.06; `flexicache` keeps it at 0.13), at 1024 all three keep it.
#[test]
fn smollm2_keeps_the_needle_within_its_measured_kl() -> Result<()> {
    let loaded = common::load_default_gguf()?;
    let (text, _) = needle()?;
    let prompt = loaded
        .tokenizer
        .as_ref()
        .context("tokenizer")?
        .encode(&text)?;
    // Measured, mean / max KL over 10 steps: quest 0.00132 / 0.00729, 0.00354 / 0.01991,
    // 0.00240 / 0.01313, 0.00533 / 0.02268; flexicache 0.00108 / 0.00362, 0.01472 /
    // 0.13221, 0.01566 / 0.14001, 0.00388 / 0.01848; clo 0.00570 / 0.01789, 0.00446 /
    // 0.01190, 0.00526 / 0.02648, 0.00445 / 0.01238; K/V stored as f16 0.00026 / 0.00156,
    // 0.00083 / 0.00310, 0.00118 / 0.00388, 0.00105 / 0.00611; as bf16 0.00041 / 0.00298,
    // 0.00114 / 0.00493, 0.00130 / 0.00787, 0.00155 / 0.00984; as q8_0 (last build only)
    // 0.00111 / 0.00630.
    held_to(
        &loaded,
        &prompt,
        " tangerine-harbor-4",
        &[
            Bound {
                spec: "quest:budget=1024",
                kv: EXACT,
                mean_kl: 0.011,
                max_kl: 0.046,
            },
            Bound {
                spec: "flexicache:budget=1024",
                kv: EXACT,
                mean_kl: 0.032,
                max_kl: 0.28,
            },
            Bound {
                spec: "clo:budget=1024",
                kv: EXACT,
                mean_kl: 0.012,
                max_kl: 0.053,
            },
            Bound {
                spec: "full",
                kv: F16,
                mean_kl: 0.0024,
                max_kl: 0.0123,
            },
            Bound {
                spec: "full",
                kv: BF16,
                mean_kl: 0.0031,
                max_kl: 0.020,
            },
            // One build measured: three times it, the most the other rows moved between
            // builds.
            Bound {
                spec: "full",
                kv: KvCodec::Q8_0,
                mean_kl: 0.0033,
                max_kl: 0.019,
            },
        ],
    )
}
