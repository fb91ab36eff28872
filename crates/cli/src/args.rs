//! The runner's flags: a contract other tools read (scripts, the server to come). Every
//! example takes the same ones.
use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use clap::Parser;
use kvpolicy::core::{DiskIo, KvCodec};
use kvpolicy::models::{activation_dtype, ModelSpec};
use kvpolicy::prefix::{Fingerprint, PrefixCache, PrefixConfig};
use kvpolicy::{GenerateConfig, HeadGroup, PolicyOptions, Profile};

/// The headings `--help` groups the flags under (the examples, kvbench and the server), in
/// the order the examples print them: a heading comes where its first flag is declared.
pub mod heading {
    /// Which model, where from, in what dtype, on which device.
    pub const MODEL: &str = "Model";
    /// The prompt's tokens.
    pub const PROMPT: &str = "Prompt";
    /// The KV policy and its settings.
    pub const POLICY: &str = "Policy";
    /// Where K/V is stored: device budget, host RAM, disk, the stored dtype, the link.
    pub const TIERS: &str = "Tiers";
    /// K/V kept across runs and requests.
    pub const PREFIX: &str = "Prefix cache and sessions";
    /// How tokens are generated.
    pub const SAMPLING: &str = "Sampling";
    /// Files written after the run.
    pub const OUTPUT: &str = "Output";
}

/// Flags shared by every example.
#[derive(Parser, Debug)]
// Each flag's help on a line of its own: the same layout in every heading, whatever its
// flags' widths.
#[command(about = "Generate text under a KV-cache policy", long_about = None, next_line_help = true)]
pub struct Args {
    /// The model: which, where, in what dtype, on which device.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text, tokenized with the model's tokenizer. Default (no prompt flag): "The capital of France is".
    #[arg(long, value_name = "TEXT", help_heading = heading::PROMPT, conflicts_with_all = ["prompt_ids", "prompts_file", "random_prompt", "prompt_file"])]
    pub prompt: Option<String>,
    /// Prompt text read from FILE (UTF-8, as is: newlines included), for a prompt too long for a command line.
    #[arg(long, value_name = "FILE", help_heading = heading::PROMPT, conflicts_with_all = ["prompt_ids", "prompts_file", "random_prompt", "chat"])]
    pub prompt_file: Option<PathBuf>,
    /// Wrap --prompt in the model's chat template as one user message.
    #[arg(long, help_heading = heading::PROMPT, requires = "prompt", conflicts_with_all = ["prompt_ids", "random_prompt", "prompts_file"])]
    pub chat: bool,
    /// Prompt as comma-separated token ids, e.g. 1,2,3 (no tokenizer needed).
    #[arg(long, value_name = "IDS", help_heading = heading::PROMPT, value_delimiter = ',', conflicts_with = "prompts_file")]
    pub prompt_ids: Option<Vec<u32>>,
    /// Prompt of N token ids drawn uniformly from the vocabulary with --seed (no tokenizer needed; for benchmarks).
    #[arg(long, value_name = "N", help_heading = heading::PROMPT, conflicts_with_all = ["prompt_ids", "prompts_file"])]
    pub random_prompt: Option<usize>,
    /// Batch mode: one prompt per line, generated together as a ragged batch; in a .jsonl file each line is a JSON array of token ids, in any other plain text (blank lines skipped).
    #[arg(long, value_name = "FILE", help_heading = heading::PROMPT, conflicts_with_all = ["decode_ids", "dump_logits"])]
    pub prompts_file: Option<PathBuf>,
    /// Teacher forcing: after the prompt, feed exactly these comma-separated ids, one decode step each. Default: the sampled tokens.
    #[arg(long, value_name = "IDS", help_heading = heading::PROMPT, value_delimiter = ',')]
    pub decode_ids: Option<Vec<u32>>,
    /// The policy and the options policies read.
    #[command(flatten)]
    pub kv: PolicyArgs,
    /// The prefix cache.
    #[command(flatten)]
    pub prefix: PrefixArgs,
    /// After generating, write the run's token ids and K/V to FILE (versioned, atomic), to continue with --load-session. Default: not saved.
    #[arg(long, value_name = "FILE", help_heading = heading::PREFIX, conflicts_with = "prompts_file")]
    pub save_session: Option<PathBuf>,
    /// Continue a saved session: its tokens come before this run's prompt, their K/V restored instead of prefilled (refused for another model or dtype). Default: a new session.
    #[arg(long, value_name = "FILE", help_heading = heading::PREFIX, conflicts_with = "prompts_file")]
    pub load_session: Option<PathBuf>,
    /// Tokens to generate after the prompt (fewer when the model ends the text).
    #[arg(long, value_name = "N", help_heading = heading::SAMPLING, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0: greedy.
    #[arg(long, value_name = "T", help_heading = heading::SAMPLING, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling: sample from the smallest set of tokens whose probability reaches P, in (0, 1]. Default: off (every token).
    #[arg(long, value_name = "P", help_heading = heading::SAMPLING)]
    pub top_p: Option<f64>,
    /// Seed of the sampler, --random-prompt and --random-weights.
    #[arg(long, value_name = "N", help_heading = heading::SAMPLING, default_value_t = 299_792_458)]
    pub seed: u64,
    /// Prompt tokens per prefill pass, so a long prompt's activations and attention scratch stay small; 0: the whole prompt in one pass.
    #[arg(long, value_name = "N", help_heading = heading::SAMPLING, default_value_t = kvpolicy::models::engine::generate::DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Write {"prompt_ids": [...], "generated_ids": [...]} as JSON to FILE (with --prompts-file, an array of one such object per prompt, in input order). Default: not written.
    #[arg(long, value_name = "FILE", help_heading = heading::OUTPUT)]
    pub ids_out: Option<PathBuf>,
    /// Write float32 logits [rows, vocab] as .npy to FILE: every prompt position, then each decode step. Default: not written.
    #[arg(long, value_name = "FILE", help_heading = heading::OUTPUT)]
    pub dump_logits: Option<PathBuf>,
    /// With --dump-logits, write only the rows that predict generated tokens (the prompt's last position, then each decode step): a long prompt's rows do not fit in memory.
    #[arg(long, help_heading = heading::OUTPUT, requires = "dump_logits")]
    pub decode_logits_only: bool,
    /// Write the policy's stats and timings as JSON to FILE (with --prompts-file also the stats after every step, as `steps`). Default: not written.
    #[arg(long, value_name = "FILE", help_heading = heading::OUTPUT)]
    pub stats_out: Option<PathBuf>,
}

/// The model flags, shared by every binary that loads a model (the examples, the server).
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Local Hugging Face model directory (config.json, *.safetensors, tokenizer.json). Default (no model flag): the program's built-in model, where it has one.
    #[arg(long, value_name = "DIR", help_heading = heading::MODEL, conflicts_with_all = ["model_id", "gguf"])]
    pub model_dir: Option<PathBuf>,
    /// Hugging Face Hub repository id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct (honours HF_HOME and HF_HUB_OFFLINE).
    #[arg(long, value_name = "ID", help_heading = heading::MODEL, conflicts_with = "gguf")]
    pub model_id: Option<String>,
    /// Hub revision (branch, tag or commit) for --model-id.
    #[arg(long, value_name = "REV", help_heading = heading::MODEL, default_value = "main", requires = "model_id")]
    pub revision: String,
    /// GGUF model file (quantized weights; tokenizer rebuilt from its vocabulary).
    #[arg(long, value_name = "FILE", help_heading = heading::MODEL)]
    pub gguf: Option<PathBuf>,
    /// tokenizer.json to use. Default: the model's own.
    #[arg(long, value_name = "FILE", help_heading = heading::MODEL)]
    pub tokenizer: Option<PathBuf>,
    /// Activation and weight dtype of safetensors and random-weight models (GGUF models keep their own). Default: f32 on the CPU, bf16 on CUDA.
    #[arg(long, value_name = "f32|f16|bf16", help_heading = heading::MODEL)]
    pub dtype: Option<String>,
    /// Build the model from --config with random weights, generated on the device (for benchmarks at real scale).
    #[arg(long, help_heading = heading::MODEL, requires = "config", conflicts_with_all = ["model_dir", "model_id", "gguf"])]
    pub random_weights: bool,
    /// config.json for --random-weights.
    #[arg(long, value_name = "FILE", help_heading = heading::MODEL, requires = "random_weights")]
    pub config: Option<PathBuf>,
    /// Run on the CPU even when a GPU is available. Default: a GPU when there is one.
    #[arg(long, help_heading = heading::MODEL)]
    pub cpu: bool,
}

/// The policy flags: `--policy` and the options policies read, shared by every binary that
/// builds a policy (the examples, the server).
#[derive(clap::Args, Debug, Clone)]
pub struct PolicyArgs {
    /// KV policy: NAME or NAME:KEY=VALUE,… — full (all K/V on the device), layer and headwise (offload by layer, by head group), recompute (partial recompute, KVPR), hybrid (K/V and activation blocks), auto (what fits a budget stays, the rest is streamed: auto:64MiB), and the APPROXIMATE quest, flexicache, clo and sinks (sinks: the examples only); --list-policies prints each one's settings.
    #[arg(long, help_heading = heading::POLICY, default_value = "full", value_name = "SPEC")]
    pub policy: String,
    /// Print every policy with its settings (types, defaults, docs) and the options it reads, then exit.
    #[arg(long, help_heading = heading::POLICY)]
    pub list_policies: bool,
    /// KV heads per head group for `headwise`: a divisor of the model's KV heads, or auto; the same as --policy headwise:group=N. Default: auto.
    #[arg(long, value_name = "N|auto", help_heading = heading::POLICY)]
    pub head_group: Option<HeadGroup>,
    /// Force `recompute` to regenerate the first N cached tokens of every layer (clamped to the tokens cached so far); the same as --policy recompute:split=N. Default: the scheduler's split.
    #[arg(long, value_name = "N", help_heading = heading::POLICY)]
    pub recompute_split: Option<usize>,
    /// Tokens per cache block for `hybrid`; the same as --policy hybrid:block_size=N. Default: 16.
    #[arg(long, value_name = "N", help_heading = heading::POLICY)]
    pub block_size: Option<usize>,
    /// Force `hybrid`'s share of blocks stored as K/V, in [0, 1] (1: all K/V, 0.5: 1:1, 0: all activations); the same as --policy hybrid:kv_act_ratio=R. Default: balanced from the profile.
    #[arg(long, value_name = "R", help_heading = heading::POLICY, allow_negative_numbers = true)]
    pub kv_act_ratio: Option<f64>,
    /// Cost profile for `recompute` and `hybrid` (JSON: h2d_bytes_per_s, recompute_tokens_per_s). Default: measured at the first step.
    #[arg(long, value_name = "FILE", help_heading = heading::POLICY)]
    pub profile: Option<PathBuf>,
    /// Device memory for K/V buffers, in bytes: a number with an optional unit B, KB, MB, GB, TB, KiB, MiB, GiB or TiB (64MiB, 2GB). Default: no limit.
    #[arg(long, value_name = "BYTES", help_heading = heading::TIERS, value_parser = parse_budget)]
    pub device_kv_budget: Option<u64>,
    /// Host RAM for K/V, in bytes (e.g. 8GiB); layers past it go to files under --disk-dir. Default: no limit, but with --disk-dir alone every layer's K/V is on disk.
    #[arg(long, value_name = "BYTES", help_heading = heading::TIERS, value_parser = parse_budget, requires = "disk_dir")]
    pub host_kv_budget: Option<u64>,
    /// LOSSY: store the host and disk tiers' K/V as f16, bf16 (half of f32's bytes) or q8_0 (0.27×), expanded before attention; logits differ from full. Default: as --kv-dtype.
    #[arg(long, value_name = "f16|bf16|q8_0", help_heading = heading::TIERS, value_parser = parse_host_dtype)]
    pub host_kv_dtype: Option<KvCodec>,
    /// LOSSY unless f32: store K/V as f16, bf16 or q8_0 (34 bytes per 32 values; head width a multiple of 32) on every tier, read in place by attention; like llama.cpp's --cache-type-k/v. Default: the model's dtype (lossless).
    #[arg(long, value_name = "f32|f16|bf16|q8_0", help_heading = heading::TIERS, value_parser = parse_kv_dtype)]
    pub kv_dtype: Option<KvCodec>,
    /// Directory for the disk tier's files (one per layer; removed at the end, on error and on Ctrl-C). Default: no disk tier.
    #[arg(long, value_name = "DIR", help_heading = heading::TIERS)]
    pub disk_dir: Option<PathBuf>,
    /// How the disk tier reads its files: direct (O_DIRECT, past the page cache; buffered where the file system refuses it) or buffered (through the page cache).
    #[arg(
        long,
        value_name = "direct|buffered",
        help_heading = heading::TIERS,
        requires = "disk_dir",
        default_value = "direct"
    )]
    pub disk_io: DiskIo,
    /// Simulate a host↔device link of this many bytes per second on the CPU (e.g. 200MB; units as --device-kv-budget), so offload policies pay transfer time as on a GPU. Default: none (plain copies).
    #[arg(long, value_name = "BYTES", help_heading = heading::TIERS, value_parser = parse_budget)]
    pub link_bandwidth: Option<u64>,
}

/// The prefix cache's flags (docs/reuse.md).
#[derive(clap::Args, Debug, Clone)]
pub struct PrefixArgs {
    /// Prefix cache directory (created if missing): prompt K/V is kept in chunks, in host RAM and in files here, and a later prompt with the same start, in this run or another, restores them instead of prefilling (full, layer, headwise, auto). Default: no cache.
    #[arg(long, value_name = "DIR", help_heading = heading::PREFIX)]
    pub prefix_cache: Option<PathBuf>,
    /// Host RAM the prefix cache keeps chunks in, in bytes (0: files only); alone, without --prefix-cache, a RAM-only cache for this run. Default: 2GiB.
    #[arg(long, value_name = "BYTES", help_heading = heading::PREFIX, value_parser = parse_size_or_zero)]
    pub prefix_cache_ram: Option<u64>,
    /// Bytes of chunk files kept under --prefix-cache; the least recently used files are removed past it. Default: 8GiB.
    #[arg(long, value_name = "BYTES", help_heading = heading::PREFIX, value_parser = parse_budget, requires = "prefix_cache")]
    pub prefix_cache_disk: Option<u64>,
    /// Tokens per prefix-cache chunk: a prompt reuses whole chunks only.
    #[arg(long, value_name = "N", help_heading = heading::PREFIX, default_value_t = kvpolicy::prefix::DEFAULT_CHUNK_TOKENS)]
    pub prefix_cache_chunk: usize,
}

impl PrefixArgs {
    /// Whether a cache is asked for (a directory, or RAM alone).
    pub fn wanted(&self) -> bool {
        self.prefix_cache.is_some() || self.prefix_cache_ram.is_some()
    }

    /// The flag that asks for the cache (`None`: none does).
    pub fn flag(&self) -> Option<&'static str> {
        if self.prefix_cache.is_some() {
            Some("--prefix-cache")
        } else if self.prefix_cache_ram.is_some() {
            Some("--prefix-cache-ram")
        } else {
            None
        }
    }

    /// Combinations that keep nothing, refused before the model loads.
    pub fn check(&self) -> Result<()> {
        if self.prefix_cache_chunk == 0 {
            anyhow::bail!(
                "--prefix-cache-chunk 0: a chunk holds at least one token (the default is 256)"
            );
        }
        if self.prefix_cache_ram == Some(0) && self.prefix_cache.is_none() {
            anyhow::bail!(
                "--prefix-cache-ram 0 without --prefix-cache keeps nothing anywhere; give a directory (--prefix-cache DIR) or some RAM (e.g. --prefix-cache-ram 2GiB)"
            );
        }
        Ok(())
    }

    /// The cache the flags ask for, for the model of `fingerprint` (its directory created
    /// if needed); `None` when none is asked for.
    pub fn open(&self, fingerprint: Fingerprint) -> Result<Option<PrefixCache>> {
        if !self.wanted() {
            return Ok(None);
        }
        let defaults = PrefixConfig::default();
        let cfg = PrefixConfig {
            chunk_tokens: self.prefix_cache_chunk,
            ram_bytes: self.prefix_cache_ram.unwrap_or(defaults.ram_bytes),
            dir: self.prefix_cache.clone(),
            disk_bytes: self.prefix_cache_disk.unwrap_or(defaults.disk_bytes),
            disk_io: defaults.disk_io,
        };
        Ok(Some(
            PrefixCache::open(&cfg, fingerprint).context("--prefix-cache")?,
        ))
    }
}

impl Args {
    /// The generation settings the flags ask for.
    pub fn generate_config(&self) -> GenerateConfig {
        GenerateConfig {
            prefill_chunk: self.prefill_chunk,
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            decode_ids: self.decode_ids.clone(),
            collect_logits: self.dump_logits.is_some(),
            decode_logits_only: self.decode_logits_only,
            stop_at_eos: true,
            progress: true,
        }
    }
}

impl ModelArgs {
    /// Whether a model flag was given (else the example's default model loads).
    pub fn explicit(&self) -> bool {
        self.model_dir.is_some()
            || self.model_id.is_some()
            || self.gguf.is_some()
            || self.random_weights
    }

    /// The model the flags name, `default` when none does; `seed` draws random weights.
    pub fn spec(&self, default: ModelSpec, seed: u64) -> Result<ModelSpec> {
        Ok(match (&self.model_dir, &self.model_id, &self.gguf) {
            _ if self.random_weights => ModelSpec::Random {
                config: self
                    .config
                    .clone()
                    .context("--random-weights needs --config FILE")?,
                seed,
            },
            (Some(d), _, _) => ModelSpec::Dir(d.clone()),
            (_, Some(id), _) => ModelSpec::Hub {
                id: id.clone(),
                revision: self.revision.clone(),
            },
            (_, _, Some(g)) => ModelSpec::Gguf(g.clone()),
            _ => default,
        })
    }

    /// The device: the CPU with `--cpu`, else a GPU when there is one — the first, or under
    /// `mpirun` the one of this rank's place on its machine (one GPU per rank; modulo the
    /// GPUs it sees, so a launcher that gives each rank one GPU of its own works too).
    pub fn device(&self) -> Result<Device> {
        if self.cpu {
            return Ok(Device::Cpu);
        }
        let Some(ranks) = kvpolicy::helix::world::launched_ranks() else {
            return Ok(Device::cuda_if_available(0)?);
        };
        let local = match kvpolicy::helix::world::visible_gpus() {
            0 => kvpolicy::helix::world::launched_local_rank(),
            n => kvpolicy::helix::world::launched_local_rank() % n,
        };
        Device::cuda_if_available(local).with_context(|| {
            format!(
                "rank {} of {ranks} could not open GPU {local}",
                kvpolicy::helix::world::launched_rank()
            )
        })
    }

    /// The activation dtype `--dtype` asks for on `device`.
    pub fn dtype(&self, device: &Device) -> Result<DType> {
        activation_dtype(self.dtype.as_deref(), device).with_context(|| {
            format!(
                "unknown --dtype `{}`; use f32, f16 or bf16",
                self.dtype.as_deref().unwrap_or_default()
            )
        })
    }
}

impl PolicyArgs {
    /// The policy's name: `--policy`'s spec before its settings.
    pub fn policy_name(&self) -> &str {
        self.policy
            .split_once(':')
            .map_or(self.policy.as_str(), |(name, _)| name)
            .trim()
    }

    /// The options the flags set, for policies on `device`.
    pub fn options(&self, device: &Device) -> Result<PolicyOptions> {
        Ok(PolicyOptions {
            device: device.clone(),
            device_kv_budget: self.device_kv_budget,
            profile: self.profile.as_deref().map(Profile::load).transpose()?,
            link_bandwidth: self.link_bandwidth.map(|b| b as f64),
            host_kv_budget: self.host_kv_budget,
            disk_dir: self.disk_dir.clone(),
            disk_io: self.disk_io,
            host_kv_dtype: self.host_kv_dtype.unwrap_or_default(),
            kv_dtype: self.kv_dtype.unwrap_or_default(),
            ..PolicyOptions::default()
        })
    }

    /// The flag that stores K/V in a smaller form, for a LOSSY label: `--kv-dtype` (other
    /// than f32) or `--host-kv-dtype` when given and read by the policy (`None`: neither).
    pub fn smaller_storage(&self) -> Option<&'static str> {
        let reg = crate::registry::registry();
        let reads = reg.reads(self.policy_name()).unwrap_or(&[]);
        let kv = self
            .kv_dtype
            .filter(|c| *c != KvCodec::Float(DType::F32))
            .filter(|_| reads.contains(&kvpolicy::PolicyOption::KvDtype));
        let host = self
            .host_kv_dtype
            .filter(|_| reads.contains(&kvpolicy::PolicyOption::HostKvDtype));
        match (kv, host) {
            (Some(_), _) => Some("--kv-dtype"),
            (None, Some(_)) => Some("--host-kv-dtype"),
            (None, None) => None,
        }
    }

    /// How the host tier stores K/V: `--host-kv-dtype`, else `--kv-dtype`, else the model's.
    pub fn host_codec(&self) -> KvCodec {
        self.host_kv_dtype.or(self.kv_dtype).unwrap_or_default()
    }
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

/// `--kv-dtype`: the forms K/V can be stored in (f32 is the model's own on the CPU).
pub fn parse_kv_dtype(s: &str) -> std::result::Result<KvCodec, String> {
    match s {
        "f32" => Ok(KvCodec::Float(DType::F32)),
        other => {
            parse_host_dtype(other).map_err(|_| format!("`{other}`: use f32, f16, bf16 or q8_0"))
        }
    }
}

/// A size that may be 0 (nothing kept there).
fn parse_size_or_zero(s: &str) -> std::result::Result<u64, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    parse_budget(s)
}

/// A byte size as the flags spell it (`64MiB`, `2GB`).
pub fn parse_budget(s: &str) -> std::result::Result<u64, String> {
    kvpolicy::parse_bytes(s).map_err(|e| e.to_string())
}
