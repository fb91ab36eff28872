//! Compare policies: a sweep of policies × context lengths on any supported model, with
//! candle-transformers' stock model as the anchor of `full` (GGUF Llama models).
//!
//! ```sh
//! cargo run --release --example kvbench -- [--gguf FILE | --model-dir DIR | --random-weights --config FILE]
//!     [--context 512,2048] [--steps 32] [--policies full,layer,headwise:1,headwise:auto,recompute,recompute:N]
//!     [--csv FILE] [--plot DIR] [--quick] [--link-bandwidth 50MB] [--profile FILE]
//! ```
//!
//! Each context is filled by a chunked prefill of deterministic token ids (or, with
//! `--synthetic-history`, random K/V stored without attention), then `--steps` decode steps
//! are timed (fixed ids, so every policy does identical work); the median of
//! `--repeats` runs is reported. Prints a markdown table (ratios ÷ `full` at the same
//! context), and optionally writes CSV and SVG charts.
mod bandwidth;
mod llamacpp;
mod plot;
mod report;
mod stock;
mod sweep;
mod synthetic;

use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvpolicy::core::KvCodec;
use kvpolicy::models::load::source::ModelFiles;
use kvpolicy::models::{activation_dtype, load, resolve, ModelSpec};
use kvpolicy::{PolicyOptions, Profile};

use kvpolicy_cli::args::heading;
use kvpolicy_cli::{atomic, errors, flags, registry, threads};
use stock::{Stock, STOCK_MAX_POSITIONS};
use sweep::{measure, Row, Variant};

/// `--help`'s heading of what is measured and how (the other headings are the runner's).
const RUNS: &str = "Runs";
/// `--help`'s heading of the implementations measured beside kvpolicy's.
const PEERS: &str = "Peers";

/// Flags.
#[derive(Parser)]
#[command(
    about = "Compare KV policies: decode/prefill speed, device and host KV bytes, traffic",
    next_line_help = true
)]
struct Args {
    /// GGUF model file. Default (no model flag): SmolLM2-135M-Instruct, fetched once.
    #[arg(long, value_name = "FILE", help_heading = heading::MODEL, conflicts_with_all = ["model_dir", "random_weights"])]
    gguf: Option<PathBuf>,
    /// Local Hugging Face model directory (config.json, *.safetensors).
    #[arg(long, value_name = "DIR", help_heading = heading::MODEL, conflicts_with = "random_weights")]
    model_dir: Option<PathBuf>,
    /// Random weights for --config (speed does not depend on the values).
    #[arg(long, help_heading = heading::MODEL, requires = "config")]
    random_weights: bool,
    /// config.json for --random-weights.
    #[arg(long, value_name = "FILE", help_heading = heading::MODEL, requires = "random_weights")]
    config: Option<PathBuf>,
    /// Activation and weight dtype of safetensors and random-weight models (GGUF models keep their own). Default: f32 on the CPU, bf16 on CUDA.
    #[arg(long, value_name = "f32|f16|bf16", help_heading = heading::MODEL)]
    dtype: Option<String>,
    /// Run on the CPU even when a GPU is available. Default: the first GPU when there is one.
    #[arg(long, help_heading = heading::MODEL)]
    cpu: bool,
    /// Context lengths in tokens, comma-separated, each filled before the timed steps.
    #[arg(long, value_name = "TOKENS", help_heading = RUNS, value_delimiter = ',', default_values_t = vec![512usize, 2048])]
    context: Vec<usize>,
    /// Timed decode steps (tokens) per run.
    #[arg(long, value_name = "N", help_heading = RUNS, default_value_t = 32)]
    steps: usize,
    /// Runs per policy and context (the median is reported).
    #[arg(long, value_name = "N", help_heading = RUNS, default_value_t = 3)]
    repeats: usize,
    /// Policy specs: NAME or NAME:KEY=VALUE,KEY=VALUE (headwise:group=1, recompute:split=64, auto:budget=64MiB, sinks:sinks=4,window=256); a lone value sets the first setting (headwise:1, auto:64MiB).
    #[arg(long, value_name = "SPECS", help_heading = RUNS, value_delimiter = ',', default_values_t = ["full", "layer", "headwise:1", "headwise:auto", "recompute"].map(String::from).to_vec())]
    policies: Vec<String>,
    /// Print every policy with its settings (types, defaults, docs), then exit.
    #[arg(long, help_heading = RUNS)]
    list_policies: bool,
    /// Cost profile for `recompute` and `hybrid` (JSON: h2d_bytes_per_s, recompute_tokens_per_s). Default: measured at the first step.
    #[arg(long, value_name = "FILE", help_heading = RUNS)]
    profile: Option<PathBuf>,
    /// Prompt tokens per prefill pass.
    #[arg(long, value_name = "N", help_heading = RUNS, default_value_t = 256)]
    prefill_chunk: usize,
    /// Fill each context with random K/V stored without attention (full, layer, headwise) instead of a prefill, to time decoding at contexts whose prefill would take hours; the prefill column is then the fill rate.
    #[arg(long, help_heading = RUNS, conflicts_with = "llamacpp")]
    synthetic_history: bool,
    /// A smoke run of about a minute: contexts 64 and 256, 4 steps, 1 repeat (overrides --context, --steps and --repeats).
    #[arg(long, help_heading = RUNS)]
    quick: bool,
    /// Also measure host→device bandwidth by copying this many MiB, and print the PCIe bound per policy. Default: not measured.
    #[arg(long, value_name = "MIB", help_heading = RUNS)]
    bandwidth_mib: Option<usize>,
    /// LOSSY unless f32: store K/V as f16, bf16 or q8_0 on every tier, as the runner's --kv-dtype; the llama.cpp row uses the same cache type. Default: the model's dtype (llama.cpp: f32).
    #[arg(long, value_name = "f32|f16|bf16|q8_0", help_heading = heading::TIERS, value_parser = kvpolicy_cli::args::parse_kv_dtype)]
    kv_dtype: Option<KvCodec>,
    /// Host RAM for K/V, in bytes: a number with an optional unit B, KB, MB, GB, TB, KiB, MiB, GiB or TiB (e.g. 8GiB); layers past it go to files under --disk-dir. Default: no limit, but with --disk-dir alone every layer's K/V is on disk.
    #[arg(long, value_name = "BYTES", help_heading = heading::TIERS, value_parser = parse_size, requires = "disk_dir")]
    host_kv_budget: Option<u64>,
    /// Directory for the disk tier's files (removed after each run). Default: no disk tier.
    #[arg(long, value_name = "DIR", help_heading = heading::TIERS)]
    disk_dir: Option<PathBuf>,
    /// How the disk tier reads: direct (O_DIRECT, past the page cache) or buffered (through it).
    #[arg(
        long,
        value_name = "direct|buffered",
        help_heading = heading::TIERS,
        requires = "disk_dir",
        default_value = "direct"
    )]
    disk_io: kvpolicy::core::DiskIo,
    /// Simulate a host↔device link of this many bytes per second (CPU only; units as --host-kv-budget), e.g. 50MB. Default: none (plain copies).
    #[arg(long, value_name = "BYTES", help_heading = heading::TIERS, value_parser = parse_size)]
    link_bandwidth: Option<u64>,
    /// Write every measurement as CSV to FILE. Default: not written.
    #[arg(long, value_name = "FILE", help_heading = heading::OUTPUT)]
    csv: Option<PathBuf>,
    /// Draw SVG charts (decode tok/s, device KV bytes, bytes moved per token) into DIR. Default: none drawn.
    #[arg(long, value_name = "DIR", help_heading = heading::OUTPUT)]
    plot: Option<PathBuf>,
    /// Skip candle-transformers' stock model, measured by default for GGUF Llama models.
    #[arg(long, help_heading = PEERS)]
    no_stock: bool,
    /// Also time llama.cpp on the same GGUF, ids, threads, chunk and steps, with this Python
    /// (llama-cpp-python 0.3.36 installed; `scripts/llamacpp_bench.py`): a `llama.cpp` row,
    /// flash attention on, its KV cache the type --kv-dtype names. Default: no llama.cpp row.
    #[arg(long, value_name = "PYTHON", help_heading = PEERS)]
    llamacpp: Option<PathBuf>,
}

fn parse_size(s: &str) -> std::result::Result<u64, String> {
    kvpolicy::parse_bytes(s).map_err(|e| e.to_string())
}

fn main() -> std::process::ExitCode {
    threads::settle();
    // kvpolicy's policies and the downstream crate's `sinks`.
    registry::install(kvpolicy_custom_policy::registry());
    let args = Args::parse();
    if args.list_policies {
        println!("{}", flags::list_policies(&registry::registry(), false));
        return std::process::ExitCode::SUCCESS;
    }
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", errors::for_cli(&e, errors::Frontend::Kvbench));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The sweep `args` asks for.
fn run(mut args: Args) -> Result<()> {
    kvpolicy_cli::ranks::Ranks::launched().refuse_for(
        "kvbench",
        "; helix across ranks is measured by scripts/helix_bench.py (mpirun over the llama example)",
    )?;
    if args.quick {
        args.context = vec![64, 256];
        args.steps = 4;
        args.repeats = 1;
    }
    anyhow::ensure!(args.steps > 0, "--steps must be at least 1");
    anyhow::ensure!(args.repeats > 0, "--repeats must be at least 1");
    atomic::on_signals();
    // Outputs are checked before the sweep, not after it.
    if let Some(path) = &args.csv {
        atomic::check_output(path, "--csv")?;
    }
    if let Some(dir) = &args.plot {
        anyhow::ensure!(
            !dir.exists() || dir.is_dir(),
            "--plot {}: not a directory",
            dir.display()
        );
    }
    let dev = if args.cpu {
        Device::Cpu
    } else {
        Device::cuda_if_available(0).map_err(|e| errors::no_gpu(e.into()))?
    };
    let dtype = activation_dtype(args.dtype.as_deref(), &dev).with_context(|| {
        format!(
            "unknown --dtype `{}`; use f32, f16 or bf16",
            args.dtype.as_deref().unwrap_or_default()
        )
    })?;
    let base = PolicyOptions {
        device: dev.clone(),
        link_bandwidth: args.link_bandwidth.map(|b| b as f64),
        profile: args.profile.as_deref().map(Profile::load).transpose()?,
        host_kv_budget: args.host_kv_budget,
        disk_dir: args.disk_dir.clone(),
        disk_io: args.disk_io,
        kv_dtype: args.kv_dtype.unwrap_or_default(),
        ..PolicyOptions::default()
    };
    let variants: Vec<Variant> = sweep::join_specs(&args.policies)?
        .iter()
        .map(|p| Variant::parse(p, &base))
        .collect::<Result<_>>()?;
    let bw = args
        .bandwidth_mib
        .map(|m| bandwidth::measure(&dev, m, base.link_bandwidth))
        .transpose()?;

    let spec = match (&args.gguf, &args.model_dir, &args.config) {
        (Some(g), _, _) => ModelSpec::Gguf(g.clone()),
        (_, Some(d), _) => ModelSpec::Dir(d.clone()),
        (_, _, Some(c)) if args.random_weights => ModelSpec::Random {
            config: c.clone(),
            seed: 1,
        },
        _ => ModelSpec::Default,
    };
    let files = resolve(&spec)?;
    let started = std::time::Instant::now();
    let loaded = load(&files, &dev, dtype, None)?;
    let load_s = started.elapsed().as_secs_f64();
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    let max_ctx = args.context.iter().copied().max().unwrap_or(0);
    anyhow::ensure!(
        max_ctx.saturating_add(args.steps) <= info.max_positions,
        "context {max_ctx} + {} steps exceeds the model's {} positions",
        args.steps,
        info.max_positions
    );
    if args.synthetic_history {
        for v in &variants {
            synthetic::check(model, v.build()?.as_mut(), &v.label)?;
        }
    }
    let mut stock = match &files {
        ModelFiles::Gguf(p)
            if !args.no_stock && !args.synthetic_history && info.architecture == "llama" =>
        {
            Some(Stock::load(p, &dev, info.vocab_size)?)
        }
        _ => None,
    };

    println!(
        "model: {} ({} layers, {} heads, {} KV heads × {}); steps {}; repeats {}; threads {}; device {:?}",
        info.source,
        info.n_layers,
        info.n_heads,
        info.n_kv_heads,
        info.head_dim,
        args.steps,
        args.repeats,
        candle_core::utils::get_num_threads(),
        dev.location()
    );
    println!("load: {load_s:.2} s");
    if let Some(c) = &info.conversion {
        println!("LOSSY model: {c}; its logits differ from the original model's");
    }
    if let Some(b) = &bw {
        let pageable = b
            .pageable
            .map_or("n/a (CPU)".into(), |p| format!("{:.2} GB/s", p / 1e9));
        println!(
            "host→device bandwidth: pageable {pageable}; transfer engine {:.2} GB/s ({})",
            b.engine / 1e9,
            if b.pinned { "page-locked" } else { "pageable" }
        );
    }
    if let Some(b) = args.link_bandwidth {
        println!("simulated link: {}/s", kvpolicy::core::format_bytes(b));
    }
    if args.synthetic_history {
        println!(
            "history: synthetic (random K/V stored with append_kv, no prefill: the prefill column is the fill rate)"
        );
    }
    let llamacpp = match (&args.llamacpp, &files) {
        (Some(python), ModelFiles::Gguf(gguf)) => Some(llamacpp::LlamaCpp {
            python: python.clone(),
            gguf: gguf.clone(),
            threads: candle_core::utils::get_num_threads(),
            chunk: args.prefill_chunk,
            kv_type: match args.kv_dtype {
                Some(KvCodec::Float(DType::F16)) => "f16",
                Some(KvCodec::Float(DType::BF16)) => "bf16",
                Some(KvCodec::Q8_0) => "q8_0",
                _ => "f32",
            },
        }),
        (Some(_), _) => anyhow::bail!("--llamacpp needs a GGUF model (--gguf, or the default)"),
        (None, _) => None,
    };
    let per_ctx = variants.len() + usize::from(stock.is_some()) + usize::from(llamacpp.is_some());
    let bar = ProgressBar::new((args.context.len() * per_ctx * args.repeats.max(1)) as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows: Vec<Row> = Vec::new();
    for &ctx in &args.context {
        for v in &variants {
            bar.set_message(format!("{} at {ctx}", v.label));
            rows.push(measure(
                model,
                v,
                ctx,
                sweep::Timing {
                    steps: args.steps,
                    repeats: args.repeats,
                    chunk: args.prefill_chunk,
                    synthetic: args.synthetic_history,
                },
                &mut || bar.inc(1),
            )?);
        }
        if let Some(s) = stock.as_mut() {
            if ctx + args.steps <= STOCK_MAX_POSITIONS {
                bar.set_message(format!("stock at {ctx}"));
                rows.push(s.measure(ctx, args.steps, args.repeats, &mut || bar.inc(1))?);
            }
        }
        if let Some(l) = &llamacpp {
            bar.set_message(format!("llama.cpp at {ctx}"));
            rows.push(l.measure(ctx, args.steps, args.repeats)?);
            bar.inc(args.repeats.max(1) as u64);
        }
    }
    bar.finish_and_clear();
    print!("{}", report::markdown(&rows, bw.map(|b| b.engine)));
    print!("{}", report::disk_lines(&rows));
    let mut seen: Vec<&Profile> = Vec::new();
    for p in rows.iter().filter_map(|r| r.profile.as_ref()) {
        if !seen.contains(&p) {
            println!("profile used: {}", serde_json::to_string(p)?);
            seen.push(p);
        }
    }
    if let Some(path) = &args.csv {
        report::write_csv(&rows, path)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(dir) = &args.plot {
        let name = std::path::Path::new(&info.source)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| info.source.clone());
        for p in plot::draw(&rows, dir, &name)? {
            eprintln!("wrote {}", p.display());
        }
        if let Some(p) = plot::draw_budget_sweep(&rows, dir, &name)? {
            eprintln!("wrote {}", p.display());
        }
    }
    Ok(())
}
