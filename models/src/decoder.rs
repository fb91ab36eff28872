//! The decoder every architecture is wired into: embeddings (optionally scaled, optionally
//! plus learned positions), pre-norm blocks around the shared [`Attention`] layer — the
//! only place a model touches its KV cache — and an LM head with an optional soft-cap.
//!
//! An architecture file only builds these pieces from its weights and config: which norm,
//! which MLP, which biases, whether blocks have Gemma 2's extra norms after attention and
//! MLP, and what each layer's [`AttnSpec`](kvpolicy_core::AttnSpec) says (window,
//! soft-cap, scale).
use candle_core::{DType, Module, Tensor};
use kvpolicy_core::KvPolicy;

use crate::attention::Attention;
use crate::error::Result;
use crate::layers::{Linear, Mlp, Norm};
use crate::model::{CausalLm, LogitsMode, ModelInfo};

/// One decoder block: `h += post_attn(attn(attn_norm(h)))`, `h += post_mlp(mlp(mlp_norm(h)))`.
#[derive(Debug, Clone)]
pub struct Block {
    /// Norm before attention.
    pub attn_norm: Norm,
    /// Attention (calls the policy).
    pub attn: Attention,
    /// Norm after attention, before the residual add (Gemma 2).
    pub post_attn_norm: Option<Norm>,
    /// Norm before the MLP.
    pub mlp_norm: Norm,
    /// Feed-forward.
    pub mlp: Mlp,
    /// Norm after the MLP, before the residual add (Gemma 2).
    pub post_mlp_norm: Option<Norm>,
}

/// A table of learned absolute positions; position `p` reads row `p + offset` (OPT: 2).
#[derive(Debug, Clone)]
pub struct LearnedPositions {
    /// `(rows, hidden)`.
    pub table: candle_nn::Embedding,
    /// Row of position 0.
    pub offset: usize,
}

/// A decoder-only transformer whose attention goes through a [`KvPolicy`].
#[derive(Debug, Clone)]
pub struct Decoder {
    /// Token embeddings.
    pub embed: candle_nn::Embedding,
    /// Factor applied to the embeddings (Gemma: `sqrt(hidden)`).
    pub embed_scale: Option<f64>,
    /// Learned positions added to the embeddings (OPT).
    pub positions: Option<LearnedPositions>,
    /// The blocks.
    pub layers: Vec<Block>,
    /// Final norm (`None` for OPT fine-tunes without one).
    pub norm: Option<Norm>,
    /// LM head.
    pub lm_head: Linear,
    /// Final-logit soft-cap `cap · tanh(logits / cap)` (Gemma 2).
    pub final_softcap: Option<f64>,
    /// Shape and identity.
    pub info: ModelInfo,
}

impl CausalLm for Decoder {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(
        &self,
        ids: &Tensor,
        pos: usize,
        policy: &mut dyn KvPolicy,
        mode: LogitsMode,
    ) -> Result<Tensor> {
        let (_b, t) = ids.dims2()?;
        let mut h = self.embed.forward(ids)?;
        if let Some(s) = self.embed_scale {
            h = (h * s)?;
        }
        if let Some(p) = &self.positions {
            let start = (pos + p.offset) as u32;
            let idx = Tensor::arange(start, start + t as u32, ids.device())?;
            h = h.broadcast_add(&p.table.forward(&idx)?)?;
        }
        for block in &self.layers {
            let mut a = block
                .attn
                .forward(&block.attn_norm.forward(&h)?, pos, policy)?;
            if let Some(n) = &block.post_attn_norm {
                a = n.forward(&a)?;
            }
            h = (h + a)?;
            let mut m = block.mlp.forward(&block.mlp_norm.forward(&h)?)?;
            if let Some(n) = &block.post_mlp_norm {
                m = n.forward(&m)?;
            }
            h = (h + m)?;
        }
        if mode == LogitsMode::Last && t > 1 {
            h = h.narrow(1, t - 1, 1)?;
        }
        if let Some(n) = &self.norm {
            h = n.forward(&h)?;
        }
        let mut logits = self.lm_head.forward(&h)?;
        if let Some(cap) = self.final_softcap {
            logits = ((logits / cap)?.tanh()? * cap)?;
        }
        Ok(logits.to_dtype(DType::F32)?)
    }
}
