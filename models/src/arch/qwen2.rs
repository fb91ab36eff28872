//! Qwen2: the Llama layout with biases on the q/k/v projections (not on the output one), a
//! large RoPE base, usually tied embeddings, and — when `use_sliding_window` is set — a
//! window on layers from `max_window_layers` on.
use crate::arch::llama::Recipe;
use crate::config::{activation, LlamaConfig};
use crate::error::Result;

/// What Qwen2 changes in the Llama recipe.
pub fn recipe(cfg: &LlamaConfig) -> Result<Recipe> {
    let sliding = cfg.use_sliding_window.unwrap_or(false);
    let from = cfg.max_window_layers.unwrap_or(cfg.num_hidden_layers);
    Ok(Recipe {
        architecture: "qwen2",
        qkv_bias: true,
        o_bias: false,
        act: activation(cfg.hidden_act.as_deref().unwrap_or("silu"), "hidden_act")?,
        windows: cfg.windows(|i| sliding && i >= from)?,
        ..Recipe::llama(cfg)?
    })
}
