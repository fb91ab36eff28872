//! The decoder every architecture is wired into: embeddings (optionally scaled, optionally
//! plus learned positions), pre-norm blocks around the shared [`Attention`] layer — the
//! only place a model touches its KV cache — and an LM head with an optional soft-cap.
//!
//! An architecture file only builds these pieces from its weights and config: which norm,
//! which MLP, which biases, whether blocks have Gemma 2's extra norms after attention and
//! MLP, and what each layer's [`AttnSpec`](kvpolicy_core::AttnSpec) says (window,
//! soft-cap, scale).
use candle_core::{DType, Device, Module, Tensor};
use kvpolicy_core::KvPolicy;

use crate::arch::attention::{Attention, Segment};
use crate::arch::layers::{Embedding, Linear, Mlp, Norm, DEQUANT_MIN_ROWS};
use crate::error::ModelError;
use crate::error::Result;
use crate::model::{CausalLm, LogitsMode, ModelInfo, SeqChunk};

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

/// The pieces of a decoder, as an architecture's builder makes them from its weights.
#[derive(Debug, Clone)]
pub struct DecoderParts {
    /// Token embeddings.
    pub embed: Embedding,
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
}

/// What a model's files say about it that its layers do not show.
#[derive(Debug, Clone)]
pub struct ModelIdentity {
    /// Architecture (`llama`, …).
    pub architecture: String,
    /// Where it was loaded from, for reports.
    pub source: String,
    /// Longest sequence (prompt + generation) the model supports.
    pub max_positions: usize,
    /// Beginning-of-sequence token, if the model has one.
    pub bos: Option<u32>,
    /// End-of-sequence tokens.
    pub eos: Vec<u32>,
    /// Activation dtype.
    pub dtype: DType,
    /// Compute device.
    pub device: Device,
    /// A lossy conversion the model's files declare ([`ModelInfo::conversion`]).
    pub conversion: Option<String>,
}

/// A decoder-only transformer whose attention goes through a [`KvPolicy`].
#[derive(Debug, Clone)]
pub struct Decoder {
    parts: DecoderParts,
    info: ModelInfo,
}

impl Decoder {
    /// The decoder of `parts`. Its [`ModelInfo`] — built here and nowhere else — reads the
    /// shape off the parts (layers; heads, head width and window of each layer's
    /// [`AttnSpec`](kvpolicy_core::AttnSpec); width and vocabulary from the LM head; the
    /// widest MLP) and the rest from `identity`.
    pub fn new(parts: DecoderParts, identity: ModelIdentity) -> Result<Self> {
        let Some(first) = parts.layers.first() else {
            return Err(ModelError::Input(
                "a decoder needs at least one layer".into(),
            ));
        };
        let spec = &first.attn.spec;
        let quantized = matches!(parts.lm_head, Linear::Quant { .. })
            || matches!(first.attn.q, Linear::Quant { .. });
        let row_split = (quantized && identity.device.is_cpu()).then_some(DEQUANT_MIN_ROWS);
        let info = ModelInfo {
            architecture: identity.architecture,
            source: identity.source,
            vocab_size: parts.lm_head.out_dim(),
            max_positions: identity.max_positions,
            n_layers: parts.layers.len(),
            n_heads: spec.n_heads,
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            hidden: parts.lm_head.in_dim(),
            intermediate: parts
                .layers
                .iter()
                .map(|b| b.mlp.inner_dim())
                .max()
                .unwrap_or(0),
            dtype: identity.dtype,
            device: identity.device,
            bos: identity.bos,
            eos: identity.eos,
            conversion: identity.conversion,
            kv_layer: parts.layers.iter().map(|b| b.attn.layer).collect(),
            windows: parts
                .layers
                .iter()
                .map(|b| b.attn.spec.sliding_window)
                .collect(),
            row_split,
        };
        Ok(Self { parts, info })
    }

    /// The pieces it runs.
    pub fn parts(&self) -> &DecoderParts {
        &self.parts
    }
}

impl Block {
    /// The block around an attention call: `attn` gets the normalised input.
    fn forward(&self, h: &Tensor, attn: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let mut a = attn(&self.attn_norm.forward(h)?)?;
        if let Some(n) = &self.post_attn_norm {
            a = n.forward(&a)?;
        }
        let h = (h + a)?;
        let mut m = self.mlp.forward(&self.mlp_norm.forward(&h)?)?;
        if let Some(n) = &self.post_mlp_norm {
            m = n.forward(&m)?;
        }
        Ok((h + m)?)
    }
}

impl Decoder {
    /// Token embeddings (scaled) plus learned positions `positions` (one per token).
    fn embed(&self, ids: &Tensor, positions: &[usize]) -> Result<Tensor> {
        let mut h = self.parts.embed.forward(ids)?;
        if let Some(s) = self.parts.embed_scale {
            h = (h * s)?;
        }
        if let Some(p) = &self.parts.positions {
            let rows: Vec<u32> = positions.iter().map(|&q| (q + p.offset) as u32).collect();
            let idx = Tensor::new(rows.as_slice(), ids.device())?;
            h = h.broadcast_add(&p.table.forward(&idx)?)?;
        }
        Ok(h)
    }

    /// Final norm, LM head and soft-cap.
    fn head(&self, h: &Tensor) -> Result<Tensor> {
        let h = match &self.parts.norm {
            Some(n) => n.forward(h)?,
            None => h.clone(),
        };
        let mut logits = self.parts.lm_head.forward(&h)?;
        if let Some(cap) = self.parts.final_softcap {
            logits = ((logits / cap)?.tanh()? * cap)?;
        }
        Ok(logits.to_dtype(DType::F32)?)
    }
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
        let positions: Vec<usize> = (pos..pos + t).collect();
        let mut h = self.embed(ids, &positions)?;
        let mut owner = None;
        for block in &self.parts.layers {
            h = block.forward(&h, |x| block.attn.forward(x, pos, policy, &mut owner))?;
        }
        if mode == LogitsMode::Last && t > 1 {
            h = h.narrow(1, t - 1, 1)?;
        }
        self.head(&h)
    }

    fn forward_batch(
        &self,
        groups: &[Vec<SeqChunk>],
        policy: &mut dyn KvPolicy,
        mode: LogitsMode,
    ) -> Result<Vec<Tensor>> {
        if policy.as_batched().is_none() {
            return Err(ModelError::Input(format!(
                "policy `{}` keeps a single sequence; build it with `build_policy_batched` (or wrap it in `PerSequence`) to run a batch",
                policy.name()
            ).into()));
        }
        let dev = &self.info.device;
        let mut hidden = Vec::with_capacity(groups.len());
        let mut segments = Vec::with_capacity(groups.len());
        for group in groups {
            let mut ids = Vec::new();
            let mut positions = Vec::new();
            let mut segs = Vec::with_capacity(group.len());
            for c in group {
                if c.ids.is_empty() {
                    return Err(ModelError::Input(
                        format!("sequence {} brings no tokens to the step", c.seq).into(),
                    ));
                }
                segs.push(Segment {
                    seq: c.seq,
                    pos: c.pos,
                    offset: ids.len(),
                    len: c.ids.len(),
                });
                ids.extend_from_slice(&c.ids);
                positions.extend(c.pos..c.pos + c.ids.len());
            }
            if ids.is_empty() {
                return Err(ModelError::Input("an empty mini-batch".into()));
            }
            let ids = Tensor::new(ids.as_slice(), dev)?.unsqueeze(0)?;
            hidden.push(self.embed(&ids, &positions)?);
            segments.push(segs);
        }
        // Column by column: every mini-batch through layer l before any enters layer l+1.
        let mut owners = vec![None; hidden.len()];
        for block in &self.parts.layers {
            for ((h, segs), owner) in hidden.iter_mut().zip(&segments).zip(&mut owners) {
                *h = block.forward(h, |x| block.attn.forward_packed(x, segs, policy, owner))?;
            }
        }
        let mut out = Vec::new();
        for (h, segs) in hidden.iter().zip(&segments) {
            let h = h.squeeze(0)?;
            match mode {
                LogitsMode::Last => {
                    let rows: Vec<u32> =
                        segs.iter().map(|s| (s.offset + s.len - 1) as u32).collect();
                    let idx = Tensor::new(rows.as_slice(), dev)?;
                    let logits = self.head(&h.index_select(&idx, 0)?)?;
                    for i in 0..segs.len() {
                        out.push(logits.narrow(0, i, 1)?);
                    }
                }
                LogitsMode::All => {
                    let logits = self.head(&h)?;
                    for s in segs {
                        out.push(logits.narrow(0, s.offset, s.len)?);
                    }
                }
            }
        }
        Ok(out)
    }
}
