//! Mistral: the Llama layout with grouped-query attention and a sliding window
//! (`sliding_window`, on every layer unless `layer_types` says otherwise). The window is
//! part of each layer's `AttnSpec`, so it holds for prefill chunks and decode steps alike,
//! and policies only keep or move the window's range.
use crate::arch::llama::Recipe;
use crate::config::{activation, LlamaConfig};
use crate::error::Result;

/// What Mistral changes in the Llama recipe.
pub fn recipe(cfg: &LlamaConfig) -> Result<Recipe> {
    Ok(Recipe {
        architecture: "mistral",
        act: activation(cfg.hidden_act.as_deref().unwrap_or("silu"), "hidden_act")?,
        windows: cfg.windows(|_| true)?,
        ..Recipe::llama(cfg)?
    })
}
