//! `config.json` of the Llama family, in both spellings found on the hub: the classic one
//! (`rope_theta`, `rope_scaling`) and the transformers-5 one (`rope_parameters`).
use serde::Deserialize;

use crate::error::{ModelError, Result};
use crate::rope::{RopeConfig, RopeScaling};

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
}

/// RoPE parameters as written in `rope_scaling` or `rope_parameters`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct RopeParams {
    /// `rope_type` (transformers ≥ 4.45 and 5) or `type` (older configs).
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    /// Base frequency (transformers 5 keeps it here).
    pub rope_theta: Option<f64>,
    /// Scaling factor.
    pub factor: Option<f64>,
    /// Llama 3: low-frequency factor.
    pub low_freq_factor: Option<f64>,
    /// Llama 3: high-frequency factor.
    pub high_freq_factor: Option<f64>,
    /// Llama 3: the context length the model was pre-trained at.
    pub original_max_position_embeddings: Option<usize>,
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
    pub rope_parameters: Option<RopeParams>,
    /// Longest sequence the model supports.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
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
}

impl LlamaConfig {
    /// Parses config.json text.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| {
            let msg = e.to_string();
            let field = msg
                .split('`')
                .nth(1)
                .map(str::to_string)
                .unwrap_or_else(|| "config.json".to_string());
            ModelError::config(field, format!("{msg}; fix config.json"))
        })
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

    /// Checks the shapes are consistent.
    pub fn validate(&self) -> Result<()> {
        let h = self.num_attention_heads;
        if h == 0 {
            return Err(ModelError::config(
                "num_attention_heads",
                "must be at least 1",
            ));
        }
        let kv = self.n_kv_heads();
        if kv == 0 || h % kv != 0 {
            return Err(ModelError::config(
                "num_key_value_heads",
                format!("{kv} does not divide num_attention_heads = {h}"),
            ));
        }
        if self.head_dim.is_none() && self.hidden_size % h != 0 {
            return Err(ModelError::config(
                "hidden_size",
                format!(
                    "{} is not a multiple of num_attention_heads = {h}",
                    self.hidden_size
                ),
            ));
        }
        if self.head_dim() % 2 != 0 {
            return Err(ModelError::config(
                "head_dim",
                "RoPE needs an even head width",
            ));
        }
        self.rope()?;
        Ok(())
    }

    /// The RoPE configuration, from either spelling.
    pub fn rope(&self) -> Result<RopeConfig> {
        let (params, prefix) = match (&self.rope_parameters, &self.rope_scaling) {
            (Some(p), _) => (p.clone(), "rope_parameters"),
            (None, Some(p)) => (p.clone(), "rope_scaling"),
            (None, None) => (RopeParams::default(), "rope_scaling"),
        };
        let theta = params.rope_theta.or(self.rope_theta).unwrap_or(10_000.0);
        let scaling = rope_scaling_from(&params, prefix)?;
        Ok(RopeConfig {
            theta,
            scaling,
            freq_factors: None,
        })
    }
}

/// Interprets a `rope_scaling` / `rope_parameters` block.
pub fn rope_scaling_from(p: &RopeParams, prefix: &str) -> Result<RopeScaling> {
    let need = |v: Option<f64>, name: &str| {
        v.ok_or_else(|| {
            ModelError::config(
                format!("{prefix}.{name}"),
                "required by this rope_type but missing",
            )
        })
    };
    match p.rope_type.as_deref().unwrap_or("default") {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: need(p.factor, "factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: need(p.factor, "factor")?,
            low_freq_factor: need(p.low_freq_factor, "low_freq_factor")?,
            high_freq_factor: need(p.high_freq_factor, "high_freq_factor")?,
            original_max_position_embeddings: p.original_max_position_embeddings.ok_or_else(
                || {
                    ModelError::config(
                        format!("{prefix}.original_max_position_embeddings"),
                        "required by rope_type llama3 but missing",
                    )
                },
            )?,
        }),
        other => Err(ModelError::config(
            format!("{prefix}.rope_type"),
            format!(
                "`{other}` is not supported; supported RoPE types are default, linear and llama3"
            ),
        )),
    }
}
