//! Gemma and Gemma 2 on the Llama layout.
//!
//! * Gemma: `head_dim` independent of hidden/heads (256), multi-query attention in the 2B
//!   model, a GeLU-tanh gated MLP, RMSNorm weights applied as `1 + w`, embeddings multiplied
//!   by `sqrt(hidden)`, tied embeddings.
//! * Gemma 2 adds attention-logit and final-logit soft-capping (`cap · tanh(x / cap)`),
//!   queries scaled by `query_pre_attn_scalar^-1/2`, sliding-window layers alternating with
//!   global ones (even layers slide unless `layer_types` says otherwise), and norms after
//!   attention and after the MLP as well as before them.
use crate::config::{activation, LlamaConfig};
use crate::error::{ModelError, Result};
use crate::llama::Recipe;

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

/// What Gemma 2 changes in the Llama recipe.
pub fn recipe2(cfg: &LlamaConfig) -> Result<Recipe> {
    for (field, v) in [
        ("attn_logit_softcapping", cfg.attn_logit_softcapping),
        ("final_logit_softcapping", cfg.final_logit_softcapping),
        ("query_pre_attn_scalar", cfg.query_pre_attn_scalar),
    ] {
        if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(ModelError::config(
                field,
                format!("{v} must be a positive number or null"),
            ));
        }
    }
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
