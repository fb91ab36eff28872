//! The `sinks` policy next to `full` on the default model (SmolLM2-135M, fetched once):
//! the same prompt teacher-forced under both, the largest logit difference and the device
//! KV each keeps — `sinks` is approximate, and says so.
//!
//! `cargo run --release -p kvpolicy-custom-policy -- [PROMPT_TOKENS] [WINDOW]`
use anyhow::{Context, Result};
use candle_core::{DType, Device, IndexOp};
use kvpolicy::models::{generate, load, resolve, GenerateConfig, ModelSpec};
use kvpolicy::{KvPolicy, PolicyOptions};
use kvpolicy_custom_policy::{registry, SinkWindow, DEFAULT_SINKS};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(600);
    let window: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(128);
    let files = resolve(&ModelSpec::Default)?;
    let loaded = load(&files, &Device::Cpu, DType::F32, None)?;
    let model = loaded.model.as_ref();
    // Every u32 is a valid id past u32's range; never 0 (the ids are `% vocab`).
    let vocab = u32::try_from(model.info().vocab_size)
        .unwrap_or(u32::MAX)
        .max(1);
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let (prompt, decode) = ids.split_at(n / 2);
    let cfg = GenerateConfig {
        decode_ids: Some(decode.to_vec()),
        collect_logits: true,
        ..GenerateConfig::default()
    };
    let run = |p: &mut dyn KvPolicy| -> Result<_> {
        let g = generate(model, p, prompt, &cfg, &mut |_| Ok(()))?;
        let logits = g.logits.context("logits")?;
        Ok((logits, p.stats().device_kv_peak_bytes))
    };
    // Built by name from a registry that holds kvpolicy's policies and this one.
    let reg = registry();
    let (want, full_kv) = run(reg.build("full", &PolicyOptions::default())?.as_mut())?;
    let mut sinks = SinkWindow::new(DEFAULT_SINKS, window);
    let (got, sinks_kv) = run(&mut sinks)?;
    let last = want.dim(0)? - 1;
    let diff = (got.i(last)? - want.i(last)?)?
        .abs()?
        .max(0)?
        .to_scalar::<f32>()?;
    println!("{n} tokens; `full` keeps {full_kv} bytes of device KV, `sinks` ({DEFAULT_SINKS} + {window}) {sinks_kv}");
    println!("APPROXIMATE: last position's logits differ from full by up to {diff:.4}");
    Ok(())
}
