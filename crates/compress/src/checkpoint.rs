//! The input checkpoint as HF-named tensors plus its `config.json` and tokenizer files: read
//! from a local safetensors directory here, or rebuilt from a GGUF file ([`crate::gguf`]).
use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::{Map, Value};

use crate::error::{CompressError, Result};

/// Architectures whose checkpoints the converter rewrites: the Llama layout without
/// per-head norms (Gemma 3's `k_norm` does not commute with the maps; OPT has no RoPE
/// split the key treatment relies on).
pub const ARCHITECTURES: &[&str] = &["llama", "mistral", "qwen2"];

/// Files copied from a model directory into the output as they are, when present.
pub const COPIED_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
];

/// A file written into the output beside the weights.
#[derive(Clone, Debug)]
pub struct NamedFile {
    /// Its name in the output directory.
    pub name: String,
    /// Its contents.
    pub bytes: Vec<u8>,
}

/// The shape `config.json` gives the attention layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Model width.
    pub hidden: usize,
}

/// A checkpoint in HF's layout, in memory.
#[derive(Debug)]
pub struct Checkpoint {
    /// `config.json`.
    pub config: Map<String, Value>,
    /// The weights by HF name, on the CPU, in their stored dtype.
    pub tensors: BTreeMap<String, Tensor>,
    /// Tokenizer and generation files for the output.
    pub files: Vec<NamedFile>,
}

fn usize_field(config: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
            CompressError::Checkpoint(format!("config.json: `{key}` is {v}, not a whole number"))
        }),
    }
}

impl Checkpoint {
    /// A local HF directory's config.json alone, its architecture checked: what the settings
    /// are checked against before any weight is read.
    pub fn header_of_dir(dir: &Path) -> Result<Self> {
        let files = kvpolicy_models::load::source::dir_files(dir)?;
        let kvpolicy_models::ModelFiles::Safetensors { config, .. } = files else {
            return Err(CompressError::Checkpoint(format!(
                "{} is not a safetensors model directory",
                dir.display()
            )));
        };
        let text = std::fs::read_to_string(&config).map_err(|e| CompressError::io(&config, e))?;
        let config: Map<String, Value> = serde_json::from_str(&text).map_err(|e| {
            CompressError::Checkpoint(format!("{}: not a JSON object: {e}", config.display()))
        })?;
        let me = Self {
            config,
            tensors: BTreeMap::new(),
            files: Vec::new(),
        };
        me.check_architecture()?;
        Ok(me)
    }

    /// Reads a local HF directory (config.json, *.safetensors, tokenizer files).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let Self { config, .. } = Self::header_of_dir(dir)?;
        let files = kvpolicy_models::load::source::dir_files(dir)?;
        let kvpolicy_models::ModelFiles::Safetensors { weights, .. } = files else {
            return Err(CompressError::Checkpoint(format!(
                "{} is not a safetensors model directory",
                dir.display()
            )));
        };
        kvpolicy_models::load::weights::check_weight_files(&weights)?;
        let mut tensors = BTreeMap::new();
        for w in &weights {
            let loaded = candle_core::safetensors::load(w, &Device::Cpu).map_err(|e| {
                CompressError::Checkpoint(format!(
                    "{}: cannot be read as safetensors: {e}",
                    w.display()
                ))
            })?;
            tensors.extend(loaded);
        }
        let mut copied = Vec::new();
        for name in COPIED_FILES {
            let p = dir.join(name);
            if p.is_file() {
                let bytes = std::fs::read(&p).map_err(|e| CompressError::io(&p, e))?;
                copied.push(NamedFile {
                    name: name.to_string(),
                    bytes,
                });
            }
        }
        Ok(Self {
            config,
            tensors,
            files: copied,
        })
    }

    /// `model_type`, which must be one of [`ARCHITECTURES`].
    pub fn check_architecture(&self) -> Result<&str> {
        let arch = self
            .config
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("");
        if !ARCHITECTURES.contains(&arch) {
            return Err(CompressError::Unsupported(format!(
                "model_type `{arch}` cannot be converted; kvpolicy-compress handles {} (Gemma's per-head key norm and OPT's learned positions are not supported)",
                ARCHITECTURES.join(", ")
            )));
        }
        Ok(arch)
    }

    /// The attention shape `config.json` gives.
    pub fn shape(&self) -> Result<AttnShape> {
        let need = |k: &str| {
            usize_field(&self.config, k)?
                .ok_or_else(|| CompressError::Checkpoint(format!("config.json has no `{k}`")))
        };
        let (layers, heads, hidden) = (
            need("num_hidden_layers")?,
            need("num_attention_heads")?,
            need("hidden_size")?,
        );
        let kv_heads = usize_field(&self.config, "num_key_value_heads")?.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(CompressError::Checkpoint(format!(
                "config.json: {heads} query heads are not a whole multiple of {kv_heads} KV heads"
            )));
        }
        let head_dim = usize_field(&self.config, "head_dim")?.unwrap_or(hidden / heads);
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(CompressError::Checkpoint(format!(
                "config.json: head width {head_dim} is not a positive even number (RoPE rotates pairs)"
            )));
        }
        Ok(AttnShape {
            layers,
            heads,
            kv_heads,
            head_dim,
            hidden,
        })
    }

    /// The tensor `name`, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| {
            CompressError::Checkpoint(format!(
                "the weights hold no `{name}` although config.json's shape needs it"
            ))
        })
    }
}
