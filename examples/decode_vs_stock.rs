//! Decode speed of our Llama under the `full` policy against candle-transformers' stock
//! quantized Llama, on the same GGUF, same machine, same run.
//!
//! `cargo run --release --example decode_vs_stock -- [--gguf FILE] [--context 128,512] [--steps 64] [--repeats 3]`
//!
//! For each context length: prefill a prompt of that many tokens, then time `--steps`
//! greedy-free decode steps (fixed token ids, so both models do identical work); the
//! median over `--repeats` alternating runs is reported.
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use clap::Parser;
use kvpolicy::models::source::{default_files, ModelFiles};
use kvpolicy::models::GgufFile;
use kvpolicy::{build_policy, CausalLm, LogitsMode, PolicyOptions};

/// Flags.
#[derive(Parser)]
struct Args {
    /// GGUF model (default: SmolLM2-135M-Instruct, fetched if needed).
    #[arg(long)]
    gguf: Option<std::path::PathBuf>,
    /// Context lengths (prompt tokens before the timed decode steps).
    #[arg(long, value_delimiter = ',', default_values_t = vec![128usize, 512, 1024])]
    context: Vec<usize>,
    /// Decode steps timed per run.
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Runs per model and context (median reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let path = match args.gguf.clone() {
        Some(p) => p,
        None => match default_files()? {
            ModelFiles::Gguf(p) => p,
            _ => anyhow::bail!("the default model did not resolve to a GGUF file; pass --gguf"),
        },
    };
    let dev = Device::Cpu;
    let ours = kvpolicy::models::llama::from_gguf(&GgufFile::open(&path)?, &dev)?;
    let mut file = std::fs::File::open(&path)?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut file)?;
    let mut stock = ModelWeights::from_gguf(content, &mut file, &dev)?;
    let vocab = ours.info().vocab_size as u32;
    let ids = |n: usize, off: usize| -> Vec<u32> {
        (0..n)
            .map(|i| ((i + off) as u32 * 7919 + 13) % vocab)
            .collect()
    };

    println!(
        "model: {}  threads: {}  steps: {}  repeats: {}",
        path.display(),
        candle_core::utils::get_num_threads(),
        args.steps,
        args.repeats
    );
    println!("| context | full tok/s | stock tok/s | full ÷ stock |");
    println!("|---:|---:|---:|---:|");
    for &ctx in &args.context {
        anyhow::ensure!(
            ctx + args.steps <= 4096,
            "candle's stock model supports 4096 positions"
        );
        let prompt = ids(ctx, 0);
        let steps = ids(args.steps, ctx);
        let (mut ours_t, mut stock_t) = (Vec::new(), Vec::new());
        for _ in 0..args.repeats {
            let mut policy = build_policy("full", &PolicyOptions::default())?;
            ours.forward(
                &Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?,
                0,
                policy.as_mut(),
                LogitsMode::Last,
            )?;
            let t = Instant::now();
            for (i, &tok) in steps.iter().enumerate() {
                let x = Tensor::new(&[tok], &dev)?.unsqueeze(0)?;
                ours.forward(&x, ctx + i, policy.as_mut(), LogitsMode::Last)?;
            }
            ours_t.push(args.steps as f64 / t.elapsed().as_secs_f64());

            stock.forward(&Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?, 0)?;
            let t = Instant::now();
            for (i, &tok) in steps.iter().enumerate() {
                let x = Tensor::new(&[tok], &dev)?.unsqueeze(0)?;
                stock.forward(&x, ctx + i).context("stock forward")?;
            }
            stock_t.push(args.steps as f64 / t.elapsed().as_secs_f64());
        }
        let (a, b) = (median(ours_t), median(stock_t));
        println!("| {ctx} | {a:.1} | {b:.1} | {:.2}× |", a / b);
    }
    Ok(())
}
