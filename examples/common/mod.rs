//! The runner every example shares: flags (a contract other tools read), model loading,
//! policy construction, generation, and the output files.
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};

mod applies;
mod atomic;
mod batch;
mod errors;
mod flags;
mod npy;
mod outpath;
mod preflight;
mod registry;
mod summary;
mod threads;
use atomic::Staged;
use candle_core::{DType, Device};
use clap::{CommandFactory, FromArgMatches, Parser};
use kvpolicy::core::{DiskIo, KvCodec};
use kvpolicy::models::{activation_dtype, generate, load, resolve, ModelSpec, TextTokenizer};
use kvpolicy::{GenerateConfig, HeadGroup, KvStats, PolicyOptions, PolicySpec, Profile};
use serde::Serialize;

/// Flags shared by every example.
#[derive(Parser, Debug)]
#[command(about = "Generate text under a KV-cache policy", long_about = None)]
pub struct Args {
    /// KV policy spec: NAME or NAME:KEY=VALUE,… — full (all on device), layer (layer-wise offload), headwise (head-wise offload; headwise:group=1), recompute (partial recompute, KVPR; recompute:split=N), hybrid (KV and activation blocks, HybridServe), auto (resident units under the budget, the rest streamed; auto:64MiB), sinks (APPROXIMATE: attention sinks + recent window, sinks:sinks=4,window=256, from the downstream crate examples/custom-policy); --list-policies prints every policy's settings.
    #[arg(long, default_value = "full", value_name = "SPEC")]
    pub policy: String,
    /// Print every policy with its settings (types, defaults, docs) and the options it reads, then exit.
    #[arg(long)]
    pub list_policies: bool,
    /// Prompt text (tokenized with the model's tokenizer).
    #[arg(long, conflicts_with_all = ["prompt_ids", "prompts_file", "random_prompt"])]
    pub prompt: Option<String>,
    /// Wrap the prompt in the model's chat template as one user message (text prompts only: not with --prompt-ids, --random-prompt or --prompts-file).
    #[arg(long, requires = "prompt", conflicts_with_all = ["prompt_ids", "random_prompt", "prompts_file"])]
    pub chat: bool,
    /// Prompt as comma-separated token ids, e.g. 1,2,3 (no tokenizer needed).
    #[arg(long, value_delimiter = ',', conflicts_with = "prompts_file")]
    pub prompt_ids: Option<Vec<u32>>,
    /// Benchmark prompt: N token ids drawn uniformly from the vocabulary with --seed (no tokenizer needed; for prompts too long for a command line).
    #[arg(long, value_name = "N", conflicts_with_all = ["prompt_ids", "prompts_file"])]
    pub random_prompt: Option<usize>,
    /// Batch mode: one prompt per line, all generated together as a ragged batch; a file ending in .jsonl holds one JSON array of token ids per line, any other file plain text (blank lines are skipped).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["decode_ids", "dump_logits"])]
    pub prompts_file: Option<PathBuf>,
    /// Tokens to generate after the prompt.
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling: keep the smallest token set whose probability reaches P.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 299_792_458)]
    pub seed: u64,
    /// Local HF model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, conflicts_with_all = ["model_id", "gguf"])]
    pub model_dir: Option<PathBuf>,
    /// Hub repository id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct); honours HF_HOME and HF_HUB_OFFLINE.
    #[arg(long, conflicts_with = "gguf")]
    pub model_id: Option<String>,
    /// Hub revision (branch, tag or commit) for --model-id.
    #[arg(long, default_value = "main", requires = "model_id")]
    pub revision: String,
    /// GGUF model file (quantized weights; tokenizer rebuilt from its vocabulary).
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// tokenizer.json to use instead of the model's own.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Activation/weight dtype for safetensors models: f32, f16 or bf16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Build the model from --config with random weights, generated on the device (for benchmarks at real scale).
    #[arg(long, requires = "config", conflicts_with_all = ["model_dir", "model_id", "gguf"])]
    pub random_weights: bool,
    /// config.json for --random-weights.
    #[arg(long, requires = "random_weights")]
    pub config: Option<PathBuf>,
    /// KV heads per head group for `headwise`: a divisor of the model's KV heads, or auto (default); the same as --policy headwise:group=N.
    #[arg(long)]
    pub head_group: Option<HeadGroup>,
    /// Device-tier byte budget for KV buffers, e.g. 64MiB or 2GB (default: unlimited).
    #[arg(long, value_parser = parse_budget)]
    pub device_kv_budget: Option<u64>,
    /// Host-memory byte budget for KV (layer, headwise, auto): layers past it go to files under --disk-dir.
    #[arg(long, value_parser = parse_budget, requires = "disk_dir")]
    pub host_kv_budget: Option<u64>,
    /// LOSSY, opt-in: store the host tier's (and disk tier's) K/V as f16, bf16 (half the bytes of f32) or q8_0 (0.27×) and expand them before attention (layer, headwise, auto); logits differ from full (README "Beyond host memory" gives the measured deviation).
    #[arg(long, value_name = "f16|bf16|q8_0", value_parser = parse_host_dtype)]
    pub host_kv_dtype: Option<KvCodec>,
    /// Directory for the disk tier's files (one per layer; removed at the end, on error and on Ctrl-C); without --host-kv-budget every layer's KV is on disk.
    #[arg(long, value_name = "DIR")]
    pub disk_dir: Option<PathBuf>,
    /// How the disk tier reads its files: `direct` (O_DIRECT, past the page cache; the default, buffered where the file system refuses it) or `buffered` (through the page cache).
    #[arg(
        long,
        value_name = "direct|buffered",
        requires = "disk_dir",
        default_value = "direct"
    )]
    pub disk_io: DiskIo,
    /// Cost profile for `recompute` (JSON: h2d_bytes_per_s, recompute_tokens_per_s); default: measured at the first step.
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// Force `recompute` to regenerate the first N cached tokens of every layer (clamped to the tokens cached so far) instead of the scheduler's split; the same as --policy recompute:split=N.
    #[arg(long, value_name = "N")]
    pub recompute_split: Option<usize>,
    /// Tokens per cache block for `hybrid` (default 16); the same as --policy hybrid:block_size=N.
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Force `hybrid`'s share of blocks stored as K/V, in [0, 1]: 1 = all KV, 0.5 = 1:1, 0 = all activations (default: balanced from the profile); the same as --policy hybrid:kv_act_ratio=R.
    #[arg(long, value_name = "R", allow_negative_numbers = true)]
    pub kv_act_ratio: Option<f64>,
    /// Simulate a host↔device link of this many bytes per second on the CPU (e.g. 200MB), so offload policies pay transfer time as on a GPU.
    #[arg(long, value_parser = parse_budget, value_name = "BYTES")]
    pub link_bandwidth: Option<u64>,
    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    pub cpu: bool,
    /// Prompt tokens per prefill pass, so that a long prompt's activations and attention scratch stay small (0 = the whole prompt in one pass).
    #[arg(long, default_value_t = kvpolicy::models::generate::DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Teacher forcing: after the prompt, feed exactly these comma-separated ids, one decode step each.
    #[arg(long, value_delimiter = ',')]
    pub decode_ids: Option<Vec<u32>>,
    /// Write {"prompt_ids": [...], "generated_ids": [...]} as JSON to FILE; with --prompts-file, a JSON array of one such object per prompt, in input order.
    #[arg(long)]
    pub ids_out: Option<PathBuf>,
    /// Write float32 logits [rows, vocab] as .npy: every prompt position, then each decode step.
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,
    /// Write the policy's stats and timings as JSON to FILE (with --prompts-file also the stats after every step, as `steps`).
    #[arg(long)]
    pub stats_out: Option<PathBuf>,
}

impl Args {
    /// The policy's name: `--policy`'s spec before its settings.
    pub fn policy_name(&self) -> &str {
        self.policy
            .split_once(':')
            .map_or(self.policy.as_str(), |(name, _)| name)
            .trim()
    }
}

/// What --stats-out writes.
#[derive(Serialize)]
pub(crate) struct StatsOut<'a> {
    #[serde(flatten)]
    stats: KvStats,
    policy: &'a str,
    model: &'a str,
    prefill_tokens: usize,
    prefill_s: f64,
    decode_tokens: usize,
    decode_s: f64,
    /// Peak resident memory of the process (Linux `VmHWM`), measured at the end of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_rss_bytes: Option<u64>,
    /// Stats after every step (batch mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    steps: Option<Vec<KvStats>>,
}

/// The process's peak resident memory from `/proc/self/status` (`VmHWM`), where there is one.
pub(crate) fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `n` token ids drawn uniformly from `0..vocab` with `seed` (the `--random-prompt` prompt).
fn random_prompt(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    // SplitMix64: a fixed, documented sequence for a seed, independent of crate versions.
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % vocab.max(1) as u64) as u32
        })
        .collect()
}

/// `--host-kv-dtype`: the smaller forms the host tier can store.
fn parse_host_dtype(s: &str) -> std::result::Result<KvCodec, String> {
    match s {
        "f16" => Ok(KvCodec::Float(DType::F16)),
        "bf16" => Ok(KvCodec::Float(DType::BF16)),
        "q8_0" => Ok(KvCodec::Q8_0),
        other => Err(format!("`{other}`: use f16, bf16 or q8_0")),
    }
}

/// Parses the flags, runs, and maps errors to a message and exit code 1. `example` is the
/// example's name, `archs` the architectures (`ModelInfo::architecture`) it runs and
/// `default` the model it loads when no model flag is given.
pub fn main(example: &str, archs: &[&str], default: Option<ModelSpec>) -> ExitCode {
    threads::settle();
    let matches = Args::command().get_matches();
    let args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    init_tracing();
    let reg = registry::registry();
    if args.list_policies {
        println!("{}", flags::list_policies(&reg));
        return ExitCode::SUCCESS;
    }
    let fail = |e: anyhow::Error| {
        eprintln!("error: {}", errors::for_cli(&e, errors::Frontend::Runner));
        ExitCode::FAILURE
    };
    let spec = match flags::run_spec(&reg, &matches, &args.policy) {
        Ok((spec, warnings)) => {
            for warning in warnings {
                eprintln!("{warning}");
            }
            spec
        }
        Err(e) => return fail(e),
    };
    atomic::on_signals();
    match run(&args, &spec, example, archs, default) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

/// With `RUST_LOG` set (e.g. `RUST_LOG=kvpolicy_models=debug`), the `load`,
/// `prefill_chunk` and `decode_step` spans print on stderr with their durations.
fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_none() {
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(std::io::stderr)
        .try_init();
}

fn parse_budget(s: &str) -> std::result::Result<u64, String> {
    kvpolicy::parse_bytes(s).map_err(|e| e.to_string())
}

fn parse_dtype(s: Option<&str>, dev: &Device) -> Result<DType> {
    activation_dtype(s, dev).with_context(|| {
        format!(
            "unknown --dtype `{}`; use f32, f16 or bf16",
            s.unwrap_or_default()
        )
    })
}

/// The example that runs `arch`.
fn example_for(arch: &str) -> &'static str {
    match arch {
        "mistral" => "mistral",
        "qwen2" => "qwen",
        "gemma" | "gemma2" | "gemma3" => "gemma",
        "opt" => "opt",
        _ => "llama",
    }
}

fn run(
    args: &Args,
    spec: &PolicySpec,
    example: &str,
    archs: &[&str],
    default: Option<ModelSpec>,
) -> Result<()> {
    let explicit = args.model_dir.is_some()
        || args.model_id.is_some()
        || args.gguf.is_some()
        || args.random_weights;
    let default = match default {
        Some(d) => d,
        None if explicit => ModelSpec::Default,
        None => anyhow::bail!(
            "the `{example}` example needs a model: pass --model-dir DIR, --gguf FILE, --model-id ID or --random-weights --config FILE (`--example llama` and `--example gemma` have built-in default models)"
        ),
    };
    let device = if args.cpu {
        Device::Cpu
    } else {
        Device::cuda_if_available(0)?
    };
    let dtype = parse_dtype(args.dtype.as_deref(), &device)?;
    // Fail on a bad policy name before loading anything.
    let opts = PolicyOptions {
        device: device.clone(),
        device_kv_budget: args.device_kv_budget,
        profile: args.profile.as_deref().map(Profile::load).transpose()?,
        link_bandwidth: args.link_bandwidth.map(|b| b as f64),
        host_kv_budget: args.host_kv_budget,
        disk_dir: args.disk_dir.clone(),
        disk_io: args.disk_io,
        host_kv_dtype: args.host_kv_dtype.unwrap_or_default(),
        ..PolicyOptions::default()
    };
    let mut policy = if args.prompts_file.is_some() {
        registry::registry().build_batched_spec(spec, &opts)?
    } else {
        registry::registry().build_spec(spec, &opts)?
    };
    // Output paths that cannot be written fail before any work.
    for (path, flag) in [
        (&args.ids_out, "--ids-out"),
        (&args.dump_logits, "--dump-logits"),
        (&args.stats_out, "--stats-out"),
    ] {
        if let Some(p) = path {
            atomic::check_output(p, flag)?;
        }
    }
    // A prompts file that cannot be read fails before the model loads.
    let batch = args.prompts_file.as_deref().map(batch::read).transpose()?;

    let spec = match (&args.model_dir, &args.model_id, &args.gguf) {
        _ if args.random_weights => ModelSpec::Random {
            config: args
                .config
                .clone()
                .context("--random-weights needs --config FILE")?,
            seed: args.seed,
        },
        (Some(d), _, _) => ModelSpec::Dir(d.clone()),
        (_, Some(id), _) => ModelSpec::Hub {
            id: id.clone(),
            revision: args.revision.clone(),
        },
        (_, _, Some(g)) => ModelSpec::Gguf(g.clone()),
        _ => default,
    };
    let files = resolve(&spec)?;
    let loaded = load(&files, &device, dtype, args.tokenizer.as_deref())?;
    let model = loaded.model;
    let tok = loaded.tokenizer;
    let arch = model.info().architecture.clone();
    if !archs.contains(&arch.as_str()) {
        anyhow::bail!(
            "the `{example}` example runs {} models, but {} is a `{arch}` model; run `--example {}` (every example takes the same flags)",
            archs.join("/"),
            model.info().source,
            example_for(&arch)
        );
    }

    if let Some(prompts) = batch {
        return batch::run(args, model.as_ref(), tok.as_ref(), policy.as_mut(), prompts);
    }

    let prompt_ids = match (&args.prompt_ids, &args.prompt, args.random_prompt) {
        (_, _, Some(n)) => {
            // Checked before the ids are drawn: N sizes the prompt.
            let positions = model.info().max_positions;
            if n > positions {
                anyhow::bail!(
                    "--random-prompt {n} exceeds the model's {positions} positions; ask for at most {positions} tokens"
                );
            }
            preflight::check_random_prompt(n)?;
            random_prompt(n, model.info().vocab_size, args.seed)
        }
        (Some(ids), _, _) => ids.clone(),
        (None, p, None) => {
            let tok = tok.as_ref().context(
                "this model has no tokenizer; pass --prompt-ids, or --tokenizer tokenizer.json",
            )?;
            let text = p.as_deref().unwrap_or("The capital of France is");
            if args.chat {
                tok.encode_raw(&tok.apply_chat_template(text)?)?
            } else {
                tok.encode(text)?
            }
        }
    };

    warn_slow_link(args, model.info(), prompt_ids.len());
    preflight::check_descriptors(args, model.info(), &[prompt_ids.len()])?;
    preflight::check_disk_room(args, model.info(), &[prompt_ids.len()])?;
    let cfg = generate_config(args);
    let mut printer = Printer::new(tok.as_ref());
    let gen = generate(
        model.as_ref(),
        policy.as_mut(),
        &prompt_ids,
        &cfg,
        &mut |t| {
            printer.push(t);
            Ok(())
        },
    )?;
    printer.finish();

    let info = model.info();
    let stats = policy.stats();
    summary::print(&gen, &stats, policy.name(), args.host_kv_dtype.is_some());
    // Every output is written before any is put in place: one failing leaves none.
    let mut staged = Staged::new();
    if let Some(path) = &args.ids_out {
        let v =
            serde_json::json!({"prompt_ids": gen.prompt_ids, "generated_ids": gen.generated_ids});
        staged.add(path, |w| Ok(serde_json::to_writer(w, &v)?))?;
    }
    if let (Some(path), Some(logits)) = (&args.dump_logits, &gen.logits) {
        staged.add(path, |w| npy::write_f32_npy(logits, w))?;
    }
    if let Some(path) = &args.stats_out {
        let out = StatsOut {
            stats,
            policy: policy.name(),
            model: &info.source,
            prefill_tokens: gen.prefill_tokens,
            prefill_s: gen.prefill_s,
            decode_tokens: gen.decode_tokens,
            decode_s: gen.decode_s,
            peak_rss_bytes: peak_rss_bytes(),
            steps: None,
        };
        staged.add(path, |w| Ok(serde_json::to_writer_pretty(w, &out)?))?;
    }
    staged.commit()
}

/// Prints a warning when `--link-bandwidth` would make a decode step of a prompt of
/// `longest` tokens take minutes under a policy that reads it.
fn warn_slow_link(args: &Args, info: &kvpolicy::ModelInfo, longest: usize) {
    let reads = registry::registry()
        .reads(args.policy_name())
        .unwrap_or(&[]);
    if let (Some(bandwidth), true) = (
        args.link_bandwidth,
        reads.contains(&kvpolicy::PolicyOption::LinkBandwidth),
    ) {
        let context = longest
            .saturating_add(args.max_new_tokens)
            .min(info.max_positions);
        if let Some(w) = applies::slow_link(info, bandwidth, context) {
            eprintln!("{w}");
        }
    }
}

/// The generation settings the flags ask for.
fn generate_config(args: &Args) -> GenerateConfig {
    GenerateConfig {
        prefill_chunk: args.prefill_chunk,
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
        decode_ids: args.decode_ids.clone(),
        collect_logits: args.dump_logits.is_some(),
        stop_at_eos: true,
        progress: true,
    }
}

/// Streams generated text to stdout (or ids when the model has no tokenizer).
struct Printer<'a> {
    tok: Option<&'a TextTokenizer>,
    ids: Vec<u32>,
    shown: usize,
    /// stdout stopped accepting text (a closed pipe): print nothing more, but the run and
    /// its output files go on.
    closed: bool,
}

impl<'a> Printer<'a> {
    fn new(tok: Option<&'a TextTokenizer>) -> Self {
        Self {
            tok,
            ids: Vec::new(),
            shown: 0,
            closed: false,
        }
    }

    fn push(&mut self, id: u32) {
        self.ids.push(id);
        let text = match self.tok {
            Some(t) => {
                // Decode the whole continuation and print what is new: multi-byte characters
                // split across tokens come out whole.
                match t.decode(&self.ids) {
                    Ok(text)
                        if text.len() > self.shown
                            && text.is_char_boundary(self.shown)
                            && !text.ends_with('\u{FFFD}') =>
                    {
                        let new = text[self.shown..].to_string();
                        self.shown = text.len();
                        new
                    }
                    _ => return,
                }
            }
            None => format!("{id} "),
        };
        self.write(&text);
    }

    fn write(&mut self, text: &str) {
        if self.closed {
            return;
        }
        let mut out = std::io::stdout().lock();
        if write!(out, "{text}").and_then(|()| out.flush()).is_err() {
            self.closed = true;
        }
    }

    fn finish(&mut self) {
        self.write("\n");
    }
}
