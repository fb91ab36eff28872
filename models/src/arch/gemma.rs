//! Gemma and Gemma 2 on the Llama layout.
//!
//! * Gemma: `head_dim` independent of hidden/heads (256), multi-query attention in the 2B
//!   model, a GeLU-tanh gated MLP, RMSNorm weights applied as `1 + w`, embeddings multiplied
//!   by `sqrt(hidden)`, tied embeddings.
//! * Gemma 2 adds attention-logit and final-logit soft-capping (`cap · tanh(x / cap)`),
//!   queries scaled by `query_pre_attn_scalar^-1/2`, sliding-window layers alternating with
//!   global ones (even layers slide unless `layer_types` says otherwise), and norms after
//!   attention and after the MLP as well as before them.
//! * Gemma 3 (Gemma Team, "Gemma 3 Technical Report", 2025, §2 "Model Architecture"):
//!   Gemma 2's layout with RMSNorm on queries and keys per head (replacing the soft-cap),
//!   five local sliding-window layers to every global one (`layer_types`, or
//!   `sliding_window_pattern` = 6), and two RoPE bases: 10K on local layers, 1M (optionally
//!   scaled) on global ones.
use crate::arch::llama::Recipe;
use crate::arch::rope::{RopeConfig, RopeScaling};
use crate::config::{activation, check_theta, LlamaConfig, RopeParameters};
use crate::error::{ModelError, Result};

/// Gemma reads `hidden_act` (default and legacy `gelu`: the tanh approximation, as
/// transformers does); Gemma 2 reads `hidden_activation`.
fn act(cfg: &LlamaConfig, gemma2: bool) -> Result<candle_nn::Activation> {
    let (field, name) = if gemma2 {
        ("hidden_activation", cfg.hidden_activation.as_deref())
    } else {
        ("hidden_act", cfg.hidden_act.as_deref())
    };
    match name.unwrap_or("gelu_pytorch_tanh") {
        "gelu" if !gemma2 => Ok(candle_nn::Activation::GeluPytorchTanh),
        other => activation(other, field),
    }
}

/// What Gemma changes in the Llama recipe.
pub fn recipe(cfg: &LlamaConfig) -> Result<Recipe> {
    Ok(Recipe {
        architecture: "gemma",
        act: act(cfg, false)?,
        norm_plus_one: true,
        embed_scale: true,
        ..Recipe::llama(cfg)?
    })
}

/// Soft-caps and the query scale must be positive where given.
fn check_caps(cfg: &LlamaConfig) -> Result<()> {
    for (field, v) in [
        ("attn_logit_softcapping", cfg.attn_logit_softcapping),
        ("final_logit_softcapping", cfg.final_logit_softcapping),
        ("query_pre_attn_scalar", cfg.query_pre_attn_scalar),
    ] {
        if let Some(v) = v {
            crate::config::numbers::positive_f32(v, field)?;
        }
    }
    Ok(())
}

/// What Gemma 2 changes in the Llama recipe.
pub fn recipe2(cfg: &LlamaConfig) -> Result<Recipe> {
    check_caps(cfg)?;
    Ok(Recipe {
        architecture: "gemma2",
        act: act(cfg, true)?,
        norm_plus_one: true,
        embed_scale: true,
        sandwich_norms: true,
        attn_softcap: cfg.attn_logit_softcapping,
        final_softcap: cfg.final_logit_softcapping,
        scale: cfg.query_pre_attn_scalar.map(|s| 1.0 / s.sqrt()),
        windows: cfg.windows(|i| i % 2 == 0)?,
        ..Recipe::llama(cfg)?
    })
}

/// The RoPE of Gemma 3's local (sliding-window) layers: `rope_parameters.sliding_attention`
/// in transformers 5, else `rope_local_base_freq` (default 10,000) without scaling.
fn local_rope(cfg: &LlamaConfig) -> Result<RopeConfig> {
    if let Some(RopeParameters::PerLayerType(m)) = &cfg.rope_parameters {
        if !m.is_empty() {
            return cfg.rope_for("sliding_attention");
        }
    }
    let theta = cfg.rope_local_base_freq.unwrap_or(10_000.0);
    check_theta(theta, "rope_local_base_freq")?;
    Ok(RopeConfig {
        theta,
        scaling: RopeScaling::None,
        freq_factors: None,
    })
}

/// What Gemma 3 changes in the Llama recipe.
pub fn recipe3(cfg: &LlamaConfig) -> Result<Recipe> {
    check_caps(cfg)?;
    let pattern = cfg.sliding_window_pattern.unwrap_or(6);
    if pattern == 0 {
        return Err(ModelError::config(
            "sliding_window_pattern",
            "is 0; every N-th layer is global, N ≥ 1",
        ));
    }
    Ok(Recipe {
        architecture: "gemma3",
        act: act(cfg, true)?,
        norm_plus_one: true,
        embed_scale: true,
        sandwich_norms: true,
        qk_norm: true,
        attn_softcap: cfg.attn_logit_softcapping,
        final_softcap: cfg.final_logit_softcapping,
        // transformers' default when config.json leaves it out.
        scale: Some(1.0 / cfg.query_pre_attn_scalar.unwrap_or(256.0).sqrt()),
        windows: cfg.windows(|i| (i + 1) % pattern != 0)?,
        local_rope: Some(local_rope(cfg)?),
        ..Recipe::llama(cfg)?
    })
}
