//! `config.json`: architecture dispatch on `model_type`, the fields of the Llama-shaped
//! families (Llama, Mistral, Qwen2, Gemma, Gemma 2 share their names) in both spellings
//! found on the hub — the classic one (`rope_theta`, `rope_scaling`) and the transformers-5
//! one (`rope_parameters`) — and OPT's own fields.
use serde::Deserialize;

use crate::error::{ModelError, Result};

pub mod numbers;
mod reductions;
mod rope;
pub use rope::{check_theta, rope_for, rope_scaling_from, RopeParameters, RopeParams};

/// A token id or a list of them (`eos_token_id` is either on the hub).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids as a list.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            Self::One(i) => vec![*i],
            Self::Many(v) => v.clone(),
        }
    }

    /// The first id of an optional field (`bos_token_id`).
    pub fn first_of(ids: &Option<TokenIds>) -> Option<u32> {
        ids.as_ref().and_then(|i| i.to_vec().first().copied())
    }

    /// Every id of an optional field (`eos_token_id`).
    pub fn all_of(ids: &Option<TokenIds>) -> Vec<u32> {
        ids.as_ref().map(TokenIds::to_vec).unwrap_or_default()
    }
}

fn default_eps() -> f64 {
    1e-5
}

fn default_max_pos() -> usize {
    2048
}

/// config.json of a Llama-family model (Llama 2, Llama 3, SmolLM2).
#[derive(Clone, Debug, Deserialize)]
pub struct LlamaConfig {
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (defaults to the query heads).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// MLKV (arXiv 2406.09297): how many layers project K/V; every other layer attends over
    /// the cache of the nearest KV layer below it (absent: every layer).
    #[serde(default)]
    pub num_key_value_layers: Option<usize>,
    /// Head width (defaults to hidden / heads).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Classic spelling of the RoPE base.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// Classic spelling of RoPE scaling.
    #[serde(default)]
    pub rope_scaling: Option<RopeParams>,
    /// transformers-5 spelling of RoPE base and scaling.
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// Gemma 3, classic spelling: the RoPE base of the sliding-window layers.
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    /// Gemma 3, classic spelling: every N-th layer attends globally, the rest slide.
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    /// Longest sequence the model supports.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the embedding matrix (absent: transformers' default for
    /// the architecture — tied for Gemma, untied otherwise).
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// Biases on the q/k/v/o projections.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
    /// End-of-sequence token(s).
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Sliding attention window in tokens (Mistral, Qwen2, Gemma 2).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Qwen2: whether `sliding_window` is used at all.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Qwen2: layers below this index attend globally.
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// transformers ≥ 4.53: `sliding_attention` / `full_attention` per layer.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Activation of the MLP gate (Llama family: `silu`).
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Gemma's spelling of the MLP activation (`gelu_pytorch_tanh`).
    #[serde(default)]
    pub hidden_activation: Option<String>,
    /// Gemma 2: attention-logit soft-cap.
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Gemma 2: final-logit soft-cap.
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Gemma 2: queries are scaled by `query_pre_attn_scalar^-1/2` instead of `head_dim^-1/2`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// What `kvpolicy-compress` did to the checkpoint (`{"lossy": true, "method": "svd",
    /// "kv_heads": {"from": 3, "to": 1}, …}`); absent for an unconverted model.
    #[serde(default)]
    pub kvpolicy_conversion: Option<serde_json::Value>,
}

/// An MLP activation named in config.json.
pub fn activation(name: &str, field: &str) -> Result<candle_nn::Activation> {
    use candle_nn::Activation as A;
    Ok(match name {
        "silu" | "swish" => A::Silu,
        "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => A::GeluPytorchTanh,
        "gelu" => A::Gelu,
        "relu" => A::Relu,
        other => {
            return Err(ModelError::config(
                field,
                format!("`{other}` is not supported; supported activations are silu, gelu, gelu_pytorch_tanh and relu"),
            ))
        }
    })
}

/// A decoder's sizes: at least one layer, and each of `fields` at least one (a zero width or
/// vocabulary divides by zero or wraps around further on).
fn check_sizes(num_hidden_layers: usize, fields: &[(&str, usize)]) -> Result<()> {
    if num_hidden_layers == 0 {
        return Err(ModelError::config(
            "num_hidden_layers",
            "is 0; a decoder needs at least one layer",
        ));
    }
    match fields.iter().find(|(_, v)| *v == 0) {
        Some((field, _)) => Err(ModelError::config(*field, "is 0; it must be at least 1")),
        None => Ok(()),
    }
}

impl LlamaConfig {
    /// The RoPE configuration, from either spelling (the `full_attention` one where
    /// `rope_parameters` has one per layer type).
    pub fn rope(&self) -> Result<crate::arch::rope::RopeConfig> {
        self.rope_for("full_attention")
    }

    /// The RoPE configuration of layers of `layer_type` ([`rope_for`]).
    pub fn rope_for(&self, layer_type: &str) -> Result<crate::arch::rope::RopeConfig> {
        rope_for(
            self.rope_parameters.as_ref(),
            self.rope_scaling.as_ref(),
            self.rope_theta,
            layer_type,
        )
    }

    /// Per layer: the sliding window, if that layer has one. `default_sliding(i)` says
    /// which layers slide when config.json has no `layer_types`.
    pub fn windows(&self, default_sliding: impl Fn(usize) -> bool) -> Result<Vec<Option<usize>>> {
        let n = self.num_hidden_layers;
        let sliding: Vec<bool> = match &self.layer_types {
            Some(types) => {
                if types.len() != n {
                    return Err(ModelError::config(
                        "layer_types",
                        format!("has {} entries for {n} layers", types.len()),
                    ));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(true),
                        "full_attention" => Ok(false),
                        other => Err(ModelError::config(
                            "layer_types",
                            format!("`{other}` is not supported; use sliding_attention or full_attention"),
                        )),
                    })
                    .collect::<Result<_>>()?
            }
            None => (0..n).map(default_sliding).collect(),
        };
        if self.sliding_window == Some(0) {
            return Err(ModelError::config("sliding_window", "must be at least 1"));
        }
        Ok(sliding
            .into_iter()
            .map(|s| if s { self.sliding_window } else { None })
            .collect())
    }

    /// Parses config.json text.
    pub fn from_json(text: &str) -> Result<Self> {
        typed(text)
    }

    /// KV heads.
    pub fn n_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Checks the shapes are consistent and the numbers make sense.
    pub fn validate(&self) -> Result<()> {
        check_sizes(
            self.num_hidden_layers,
            &[
                ("hidden_size", self.hidden_size),
                ("vocab_size", self.vocab_size),
                ("head_dim", self.head_dim.unwrap_or(1)),
            ],
        )?;
        numbers::non_negative_f32(self.rms_norm_eps, "rms_norm_eps")?;
        let h = self.num_attention_heads;
        if h == 0 {
            return Err(ModelError::config(
                "num_attention_heads",
                "must be at least 1",
            ));
        }
        let kv = self.n_kv_heads();
        if kv == 0 || !h.is_multiple_of(kv) {
            return Err(ModelError::config(
                "num_key_value_heads",
                format!("{kv} does not divide num_attention_heads = {h}"),
            ));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(h) {
            return Err(ModelError::config(
                "hidden_size",
                format!(
                    "{} is not a multiple of num_attention_heads = {h}",
                    self.hidden_size
                ),
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(ModelError::config(
                "head_dim",
                "RoPE needs an even head width",
            ));
        }
        self.rope()?;
        Ok(())
    }
}

fn yes() -> bool {
    true
}

fn relu() -> String {
    "relu".into()
}

/// config.json of an OPT model (125M–66B layout).
#[derive(Clone, Debug, Deserialize)]
pub struct OptConfig {
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub ffn_dim: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Heads (OPT is multi-head: as many KV heads).
    pub num_attention_heads: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence (the position table has 2 more rows).
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Pre-norm blocks (true for every size but 350M).
    #[serde(default = "yes")]
    pub do_layer_norm_before: bool,
    /// Embedding width when it differs from `hidden_size` (350M's projections).
    #[serde(default)]
    pub word_embed_proj_dim: Option<usize>,
    /// MLP activation.
    #[serde(default = "relu")]
    pub activation_function: String,
    /// Biases on every projection.
    #[serde(default = "yes")]
    pub enable_bias: bool,
    /// LayerNorms with weight and bias.
    #[serde(default = "yes")]
    pub layer_norm_elementwise_affine: bool,
    /// Drops the final LayerNorm (some fine-tunes).
    #[serde(default, rename = "_remove_final_layer_norm")]
    pub remove_final_layer_norm: bool,
    /// Whether the LM head shares the embedding matrix.
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
    /// End-of-sequence token(s).
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
}

impl OptConfig {
    /// Rejects the layouts this code does not implement, naming the field.
    pub fn validate(&self) -> Result<()> {
        check_sizes(
            self.num_hidden_layers,
            &[
                ("hidden_size", self.hidden_size),
                ("vocab_size", self.vocab_size),
                ("ffn_dim", self.ffn_dim),
            ],
        )?;
        if !self.do_layer_norm_before {
            return Err(ModelError::config(
                "do_layer_norm_before",
                "false (the post-norm layout of OPT-350M) is not supported; OPT-125M and OPT-1.3B…66B use true",
            ));
        }
        if let Some(d) = self.word_embed_proj_dim.filter(|&d| d != self.hidden_size) {
            return Err(ModelError::config(
                "word_embed_proj_dim",
                format!(
                    "{d} ≠ hidden_size {} (OPT-350M's embedding projections) is not supported",
                    self.hidden_size
                ),
            ));
        }
        if !self.layer_norm_elementwise_affine {
            return Err(ModelError::config(
                "layer_norm_elementwise_affine",
                "false is not supported",
            ));
        }
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(ModelError::config(
                "num_attention_heads",
                format!(
                    "{} does not divide hidden_size {}",
                    self.num_attention_heads, self.hidden_size
                ),
            ));
        }
        activation(&self.activation_function, "activation_function")?;
        Ok(())
    }
}

/// The architectures `--model-dir` loads, dispatched on config.json's `model_type`.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "model_type", rename_all = "lowercase")]
pub enum ModelConfig {
    /// Llama 2/3, SmolLM2.
    Llama(LlamaConfig),
    /// Mistral: sliding-window attention.
    Mistral(LlamaConfig),
    /// Qwen2: q/k/v biases.
    Qwen2(LlamaConfig),
    /// Gemma: GeLU-tanh, `1 + w` norms, scaled embeddings.
    Gemma(LlamaConfig),
    /// Gemma 2: Gemma plus soft-caps, sandwich norms, alternating windows.
    Gemma2(LlamaConfig),
    /// Gemma 3 (`gemma3_text`): Gemma 2 plus RMSNorm on q and k per head, five sliding
    /// layers to one global, and a RoPE base per layer type.
    #[serde(rename = "gemma3_text")]
    Gemma3(LlamaConfig),
    /// OPT: learned positions, LayerNorm, ReLU MLP, biases.
    Opt(OptConfig),
}

/// The `model_type`s [`ModelConfig`] accepts.
pub const MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "gemma",
    "gemma2",
    "gemma3_text",
    "opt",
];

/// config.json that is not JSON at all.
fn syntax_error(e: serde_json::Error) -> ModelError {
    ModelError::config("config.json", format!("{e}; fix config.json"))
}

/// A config struct parsed straight from config.json's text (no generic JSON tree: fields
/// this code does not read are skipped, not held); a value of the wrong type names its
/// field (the dotted path), e.g. `hidden_size` for `"hidden_size": -64`.
fn typed<T: serde::de::DeserializeOwned>(text: &str) -> Result<T> {
    let mut de = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let field = match e.path().to_string() {
            // A missing field has no path; serde names it in backticks.
            p if p == "." => e
                .inner()
                .to_string()
                .split('`')
                .nth(1)
                .unwrap_or("config.json")
                .to_string(),
            p => p,
        };
        ModelError::config(field, format!("{}; fix config.json", e.inner()))
    })
}

impl ModelConfig {
    /// Parses config.json text; a missing or unsupported `model_type` is an error naming it.
    pub fn from_json(text: &str) -> Result<Self> {
        /// Just the architecture; every other field is skipped unread.
        #[derive(Deserialize)]
        struct Kind {
            model_type: Option<serde_json::Value>,
        }
        let k: Kind = serde_json::from_str(text).map_err(syntax_error)?;
        let supported = MODEL_TYPES.join(", ");
        let kind = match k.model_type.as_ref().map(|t| t.as_str()) {
            None => {
                return Err(ModelError::config(
                    "model_type",
                    format!("missing; config.json must name the architecture, one of {supported}"),
                ))
            }
            Some(Some(t)) if MODEL_TYPES.contains(&t) => t.to_string(),
            Some(other) => {
                return Err(ModelError::config(
                    "model_type",
                    format!(
                        "`{}` is not supported; supported architectures are {supported}",
                        other.unwrap_or("(not a string)")
                    ),
                ))
            }
        };
        Ok(match kind.as_str() {
            "mistral" => Self::Mistral(typed(text)?),
            "qwen2" => Self::Qwen2(typed(text)?),
            "gemma" => Self::Gemma(typed(text)?),
            "gemma2" => Self::Gemma2(typed(text)?),
            "gemma3_text" => Self::Gemma3(typed(text)?),
            "opt" => Self::Opt(typed(text)?),
            _ => Self::Llama(typed(text)?),
        })
    }
}
