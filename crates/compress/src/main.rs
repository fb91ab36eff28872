//! `kvpolicy-compress`: converts a model to fewer KV heads (`--kv-heads`) or fewer KV layers
//! (`--kv-layers`, MLKV) and writes a standard HF directory (see the library docs). A LOSSY conversion: the output's `config.json` says so
//! under `kvpolicy_conversion`, and the examples' summaries and `--stats-out` repeat it.
//!
//! ```text
//! kvpolicy-compress --gguf SmolLM2.gguf --kv-heads 1 --calibration text.txt --out smollm2-kv1
//! cargo run --release --example llama -- --model-dir smollm2-kv1 --policy headwise
//! ```
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Parser, ValueEnum};
use kvpolicy_compress::calibrate::{calibrate, default_ids, DEFAULT_TOKENS};
use kvpolicy_compress::checkpoint::Checkpoint;
use kvpolicy_compress::heads::{check_target, compress_heads};
use kvpolicy_compress::{layers, output, Method, CONVERSION_KEY};
use kvpolicy_models::ModelFiles;
use serde_json::json;

/// How KV heads are merged.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum MethodArg {
    /// Principal subspaces of calibration activations, RoPE-aware for keys (Yu et al. 2024).
    Svd,
    /// The heads' projections averaged (GQA's conversion; the baseline).
    Mean,
}

/// Converts a Llama, Mistral or Qwen2 model to fewer KV heads or KV layers (LOSSY,
/// training-free) and writes an HF directory that `--model-dir` loads (and HF transformers,
/// when only heads were compressed).
#[derive(Parser, Debug)]
#[command(name = "kvpolicy-compress", version)]
struct Args {
    /// The input: a local HF directory (config.json, *.safetensors, tokenizer files).
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "gguf",
        required_unless_present = "gguf"
    )]
    model_dir: Option<PathBuf>,
    /// The input: a GGUF file (`llama` or `qwen2`), dequantized to f32.
    #[arg(long, value_name = "FILE")]
    gguf: Option<PathBuf>,
    /// The output directory: new, or empty. Written through a temporary beside it and
    /// renamed into place whole; nothing is overwritten.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// KV heads per layer in the output: a divisor of the model's KV heads (its own count
    /// copies the weights unchanged).
    #[arg(long, value_name = "N", required_unless_present = "kv_layers")]
    kv_heads: Option<usize>,
    /// Layers that keep K/V projections (MLKV, written as `num_key_value_layers`); the others
    /// read the cache of the KV layer below them, and each group's K/V projections are
    /// averaged into it. The layer count copies the weights unchanged.
    #[arg(long, value_name = "M")]
    kv_layers: Option<usize>,
    /// How heads are merged (`--kv-heads`); layers are always merged by their mean.
    #[arg(long, value_enum, default_value = "svd")]
    method: MethodArg,
    /// Calibration text (tokenized with the model's tokenizer) for `svd`.
    #[arg(long, value_name = "FILE", conflicts_with = "calibration_ids")]
    calibration: Option<PathBuf>,
    /// Calibration token ids, comma-separated (like the examples' `--prompt-ids`). Without
    /// this or `--calibration`: 512 ids drawn by a fixed xorshift over the vocabulary.
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    calibration_ids: Option<Vec<u32>>,
}

/// Most bytes of calibration text read.
const CALIBRATION_CAP: u64 = 64 << 20;

fn main() {
    output::on_signals();
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    let method = match args.method {
        MethodArg::Svd => Method::Svd,
        MethodArg::Mean => Method::Mean,
    };
    output::check_output(&args.out)?;
    // The settings are checked against config.json (or the GGUF's metadata) before any
    // weight is read.
    let header = match (&args.model_dir, &args.gguf) {
        (Some(dir), None) => Checkpoint::header_of_dir(dir)?,
        (None, Some(g)) => kvpolicy_compress::gguf::header(g)?,
        _ => bail!("give the input as --model-dir DIR or --gguf FILE"),
    };
    let shape = header.shape()?;
    let kv_heads = args.kv_heads.unwrap_or(shape.kv_heads);
    let kv_layers = args.kv_layers.unwrap_or(shape.layers);
    check_target(&shape, kv_heads)?;
    layers::check_target(&header, &shape, kv_layers)?;
    let merging = kv_heads < shape.kv_heads;
    let sharing = kv_layers < shape.layers;
    if merging && sharing && method == Method::Svd {
        bail!("--kv-heads with --method svd folds each layer's own maps into its queries, which layers sharing one cache cannot all take; with --kv-layers use --method mean, or convert in two runs");
    }
    let (mut ck, files, source) = match (&args.model_dir, &args.gguf) {
        (Some(dir), _) => (
            Checkpoint::from_dir(dir)?,
            kvpolicy_models::load::source::dir_files(dir)?,
            dir.display().to_string(),
        ),
        (None, Some(g)) => (
            kvpolicy_compress::gguf::from_gguf(g)?,
            ModelFiles::Gguf(g.clone()),
            g.display().to_string(),
        ),
        (None, None) => bail!("give the input as --model-dir DIR or --gguf FILE"),
    };
    if ck.shape()? != shape {
        bail!("the model changed while it was read");
    }
    let mut calibration_tokens = 0;
    let moments = if merging && method == Method::Svd {
        let loaded = kvpolicy_models::load(&files, &Device::Cpu, DType::F32, None)?;
        let ids = match (&args.calibration, &args.calibration_ids) {
            (_, Some(ids)) => ids.clone(),
            (Some(path), None) => {
                let text = kvpolicy_core::userfile::read_capped(
                    path,
                    "the calibration text",
                    CALIBRATION_CAP,
                )
                .with_context(|| format!("reading --calibration {}", path.display()))?;
                let text = String::from_utf8(text).with_context(|| {
                    format!("--calibration {} is not UTF-8 text", path.display())
                })?;
                let Some(tok) = &loaded.tokenizer else {
                    bail!("the model has no tokenizer.json to tokenize --calibration with; give --calibration-ids instead");
                };
                tok.encode_raw(&text)?
            }
            (None, None) => default_ids(loaded.model.info().vocab_size, DEFAULT_TOKENS),
        };
        let m = calibrate(loaded.model.as_ref(), &ids)?;
        eprintln!("calibrated on {} tokens", m.tokens);
        calibration_tokens = m.tokens;
        Some(m)
    } else {
        None
    };
    compress_heads(&mut ck, kv_heads, method, moments.as_ref())?;
    layers::share_layers(&mut ck, kv_layers)?;
    let mut label = json!({
        "lossy": merging || sharing,
        "tool": concat!("kvpolicy-compress ", env!("CARGO_PKG_VERSION")),
        "source": source,
        "kv_heads": {"from": shape.kv_heads, "to": kv_heads},
        "kv_layers": {"from": shape.layers, "to": kv_layers},
    });
    if merging {
        label["method"] = json!(method.name());
        if method == Method::Svd {
            label["calibration_tokens"] = json!(calibration_tokens);
        }
    } else if sharing {
        label["method"] = json!("mean");
    }
    if args.gguf.is_some() {
        label["dequantized_from_gguf"] = json!(true);
    }
    ck.config.insert(CONVERSION_KEY.into(), label);
    output::write(&ck, &args.out)?;
    eprintln!(
        "wrote {} ({kv_heads} KV heads, {kv_layers} of {} layers with K/V{})",
        args.out.display(),
        shape.layers,
        if merging || sharing {
            "; LOSSY: training-free conversion"
        } else {
            "; weights unchanged"
        }
    );
    Ok(())
}
