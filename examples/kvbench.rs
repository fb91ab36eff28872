//! Compare policies: decode tokens/s at several context lengths, ÷ the first policy listed,
//! with device and host KV bytes, bytes moved per token and the recompute split.
//!
//! `cargo run --release --example kvbench -- [--gguf FILE | --model-dir DIR | --random-weights --config FILE]
//!     [--context 512,2048] [--steps 32] [--policies full,layer,headwise:1,headwise:auto,recompute,recompute:N]
//!     [--link-bandwidth 50MB] [--profile FILE]`
//!
//! Each context is filled by a chunked prefill of synthetic token ids, then `--steps` decode
//! steps are timed (fixed ids, so every policy does identical work).
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use kvpolicy::models::{activation_dtype, load, prefill, resolve, ModelSpec};
use kvpolicy::{build_policy, HeadGroup, LogitsMode, PolicyOptions, Profile};

/// Flags.
#[derive(Parser)]
struct Args {
    /// GGUF model (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    gguf: Option<std::path::PathBuf>,
    /// Local HF model directory.
    #[arg(long)]
    model_dir: Option<std::path::PathBuf>,
    /// Random weights for --config.
    #[arg(long, requires = "config")]
    random_weights: bool,
    /// config.json for --random-weights.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Context lengths before the timed steps.
    #[arg(long, value_delimiter = ',', default_values_t = vec![512usize, 2048])]
    context: Vec<usize>,
    /// Timed decode steps per run.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Runs per policy and context (median reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Policies: `name`, `headwise:GROUP` or `recompute:SPLIT` (a forced split).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["full".to_string(), "layer".into(), "headwise:1".into(), "headwise:auto".into()])]
    policies: Vec<String>,
    /// Prefill chunk.
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    cpu: bool,
    /// Activation/weight dtype for safetensors and random models: f32, f16, bf16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long)]
    dtype: Option<String>,
    /// Also measure host→device bandwidth (MiB copied) and print the PCIe bound per policy.
    #[arg(long)]
    bandwidth_mib: Option<usize>,
    /// Simulate a host↔device link of this many bytes per second (CPU only), e.g. 50MB.
    #[arg(long, value_parser = parse_size)]
    link_bandwidth: Option<u64>,
    /// Cost profile for `recompute` (JSON); default: measured at the first step.
    #[arg(long)]
    profile: Option<std::path::PathBuf>,
}

fn parse_size(s: &str) -> std::result::Result<u64, String> {
    kvpolicy::parse_bytes(s).map_err(|e| e.to_string())
}

/// Host→device bandwidth in bytes/s for a `mib` MiB pageable copy (median of 5).
fn h2d_bandwidth(dev: &Device, mib: usize) -> Result<f64> {
    let n = mib * 1024 * 1024 / 4;
    let host = Tensor::zeros(n, DType::F32, &Device::Cpu)?;
    let mut v = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let d = host.to_device(dev)?;
        dev.synchronize()?;
        v.push((n * 4) as f64 / t.elapsed().as_secs_f64());
        drop(d);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[2])
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = if args.cpu {
        Device::Cpu
    } else {
        Device::cuda_if_available(0)?
    };
    let dtype = activation_dtype(args.dtype.as_deref(), &dev).with_context(|| {
        format!(
            "unknown --dtype `{}`; use f32, f16 or bf16",
            args.dtype.as_deref().unwrap_or_default()
        )
    })?;
    let profile = args.profile.as_deref().map(Profile::load).transpose()?;
    let bw = match args.bandwidth_mib {
        Some(m) => Some(h2d_bandwidth(&dev, m)?),
        None => None,
    };
    if let Some(b) = bw {
        println!("host→device bandwidth (pageable): {:.2} GB/s", b / 1e9);
    }
    let spec = match (&args.gguf, &args.model_dir, &args.config) {
        (Some(g), _, _) => ModelSpec::Gguf(g.clone()),
        (_, Some(d), _) => ModelSpec::Dir(d.clone()),
        (_, _, Some(c)) if args.random_weights => ModelSpec::Random {
            config: c.clone(),
            seed: 1,
        },
        _ => ModelSpec::Default,
    };
    let loaded = load(&resolve(&spec)?, &dev, dtype, None)?;
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    let vocab = info.vocab_size as u32;
    println!(
        "model: {} ({} layers, {} KV heads × {}); steps {}; repeats {}; threads {}",
        info.source,
        info.n_layers,
        info.n_kv_heads,
        info.head_dim,
        args.steps,
        args.repeats,
        candle_core::utils::get_num_threads()
    );
    if let Some(b) = args.link_bandwidth {
        println!("simulated link: {}/s", kvpolicy::core::format_bytes(b));
    }
    println!("| context | policy | prefill tok/s | decode tok/s | ÷ first | s/token | PCIe bound s/token | device KV peak | ÷ first | host KV | h2d bytes/token | split |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut profiles = Vec::new();
    for &ctx in &args.context {
        let prompt: Vec<u32> = (0..ctx).map(|i| (i as u32 * 7919 + 13) % vocab).collect();
        let mut base: Option<(f64, u64)> = None;
        for name in &args.policies {
            let (policy, arg) = name.split_once(':').unwrap_or((name.as_str(), ""));
            let mut opts = PolicyOptions {
                device: dev.clone(),
                link_bandwidth: args.link_bandwidth.map(|b| b as f64),
                profile: profile.clone(),
                ..PolicyOptions::default()
            };
            match (policy, arg) {
                (_, "") => {}
                ("recompute", n) => {
                    opts.recompute_split =
                        Some(n.parse().context("recompute:SPLIT needs a number")?)
                }
                (_, g) => opts.head_group = g.parse::<HeadGroup>().map_err(anyhow::Error::msg)?,
            }
            let mut prefill_rate = 0.0;
            let mut rates = Vec::new();
            let mut last = None;
            for _ in 0..args.repeats {
                let mut p = build_policy(policy, &opts)?;
                let t = Instant::now();
                prefill(model, p.as_mut(), &prompt, args.prefill_chunk, false)?;
                dev.synchronize()?;
                prefill_rate = ctx as f64 / t.elapsed().as_secs_f64();
                let before = p.stats();
                let t = Instant::now();
                for i in 0..args.steps {
                    let ids = Tensor::new(&[(i as u32 * 31 + 7) % vocab], &dev)?.unsqueeze(0)?;
                    model.forward(&ids, ctx + i, p.as_mut(), LogitsMode::Last)?;
                }
                dev.synchronize()?;
                rates.push(args.steps as f64 / t.elapsed().as_secs_f64());
                last = Some((before, p.stats()));
                if let Some(pr) = p.profile() {
                    if !profiles.contains(pr) {
                        profiles.push(pr.clone());
                    }
                }
            }
            rates.sort_by(|a, b| a.total_cmp(b));
            let rate = rates[rates.len() / 2];
            let (before, after) = last.context("no run")?;
            let peak = after.device_kv_peak_bytes;
            let (base_rate, base_peak) = *base.get_or_insert((rate, peak));
            let moved = (after.h2d_bytes - before.h2d_bytes) / args.steps as u64;
            let bound = match bw {
                Some(b) if moved > 0 => format!("{:.4}", moved as f64 / b),
                _ => "-".into(),
            };
            println!(
                "| {ctx} | {name} | {prefill_rate:.1} | {rate:.2} | {:.2} | {:.4} | {bound} | {} | {:.4} | {} | {} | {} |",
                rate / base_rate,
                1.0 / rate,
                kvpolicy::core::format_bytes(peak),
                peak as f64 / base_peak as f64,
                kvpolicy::core::format_bytes(after.host_kv_bytes),
                moved,
                after.split,
            );
        }
    }
    for p in profiles {
        println!("profile used: {}", serde_json::to_string(&p)?);
    }
    Ok(())
}
