//! RoPE in config.json: `rope_theta` / `rope_scaling` (the classic spelling),
//! `rope_parameters` (transformers 5, one block or — Gemma 3 — one per layer type), and what
//! each `rope_type` asks for.
use serde::Deserialize;

use crate::arch::rope::{RopeConfig, RopeScaling};
use crate::error::{ModelError, Result};

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

/// `rope_parameters`: one block, or one per layer type (Gemma 3 in transformers 5:
/// `{"full_attention": {...}, "sliding_attention": {...}}`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum RopeParameters {
    /// Keyed by `layer_types` entry.
    PerLayerType(std::collections::BTreeMap<String, RopeParams>),
    /// One block for every layer.
    One(RopeParams),
}

/// The RoPE configuration of layers of `layer_type` (`full_attention` or
/// `sliding_attention`) from a config's `rope_parameters`, `rope_scaling` and `rope_theta`:
/// the same for every type unless `rope_parameters` is keyed by type.
pub fn rope_for(
    parameters: Option<&RopeParameters>,
    scaling: Option<&RopeParams>,
    rope_theta: Option<f64>,
    layer_type: &str,
) -> Result<RopeConfig> {
    let (params, prefix) = match (parameters, scaling) {
        (Some(RopeParameters::One(p)), _) => (p.clone(), "rope_parameters".to_string()),
        (Some(RopeParameters::PerLayerType(m)), _) if m.is_empty() => {
            (RopeParams::default(), "rope_parameters".to_string())
        }
        (Some(RopeParameters::PerLayerType(m)), _) => {
            let prefix = format!("rope_parameters.{layer_type}");
            let p = m.get(layer_type).cloned().ok_or_else(|| {
                ModelError::config(&prefix, "missing; give one block per layer type")
            })?;
            (p, prefix)
        }
        (None, Some(p)) => (p.clone(), "rope_scaling".to_string()),
        (None, None) => (RopeParams::default(), "rope_scaling".to_string()),
    };
    let (theta, field) = match params.rope_theta {
        Some(t) => (t, format!("{prefix}.rope_theta")),
        None => (rope_theta.unwrap_or(10_000.0), "rope_theta".to_string()),
    };
    check_theta(theta, &field)?;
    let scaling = rope_scaling_from(&params, &prefix)?;
    Ok(RopeConfig {
        theta,
        scaling,
        freq_factors: None,
    })
}

/// A RoPE base must be a finite number above 0 (θ ≤ 0 makes every angle NaN or infinite).
pub fn check_theta(theta: f64, field: &str) -> Result<()> {
    super::numbers::positive_f32(theta, field).map(drop)
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
    // Every factor divides or scales a frequency: above 0 in f32, where it is used.
    let factor = |v: Option<f64>, name: &str| -> Result<f64> {
        let v = need(v, name)?;
        super::numbers::positive_f32(v, &format!("{prefix}.{name}"))?;
        Ok(v)
    };
    match p.rope_type.as_deref().unwrap_or("default") {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: factor(p.factor, "factor")?,
        }),
        "llama3" => {
            let (low, high) = (
                factor(p.low_freq_factor, "low_freq_factor")?,
                factor(p.high_freq_factor, "high_freq_factor")?,
            );
            // Llama 3's smoothing divides by high − low, in f32.
            if !((high as f32 - low as f32).is_normal() && high > low) {
                return Err(ModelError::config(
                    format!("{prefix}.high_freq_factor"),
                    format!("{high} must be above low_freq_factor {low}"),
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor: factor(p.factor, "factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: p
                    .original_max_position_embeddings
                    .filter(|&n| n > 0)
                    .ok_or_else(|| {
                        ModelError::config(
                            format!("{prefix}.original_max_position_embeddings"),
                            "required by rope_type llama3 (a positive number) but missing or 0",
                        )
                    })?,
            })
        }
        other => Err(ModelError::config(
            format!("{prefix}.rope_type"),
            format!(
                "`{other}` is not supported; supported RoPE types are default, linear and llama3"
            ),
        )),
    }
}
