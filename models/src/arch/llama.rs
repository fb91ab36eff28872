//! The Llama family (Llama 2, Llama 3 with `llama3` RoPE scaling, SmolLM2): pre-norm
//! decoder blocks of RMSNorm → attention → RMSNorm → gated-SiLU MLP, from safetensors
//! (GGUF files: `gguf_model`). Its HF weight layout is shared by Mistral, Qwen2 and Gemma (1 and 2): their files
//! describe what differs as a [`Recipe`] and build through [`from_varbuilder`].
use std::path::Path;

use candle_nn::VarBuilder;
use kvpolicy_core::AttnSpec;

use crate::arch::attention::{Attention, KvProjections};
use crate::arch::decoder::{Block, Decoder, DecoderParts, ModelIdentity};
use crate::arch::layers::{Embedding, Linear, Mlp, Norm, RmsNorm};
use crate::arch::rope::{Rope, RopeStyle};
use crate::config::{activation, LlamaConfig, TokenIds};
use crate::error::{ModelError, Result};

fn weights_err(path: &Path) -> impl Fn(candle_core::Error) -> ModelError + '_ {
    move |e| ModelError::Weights {
        path: path.to_path_buf(),
        message: format!(
            "{}; check that config.json belongs to these weights",
            crate::error::candle_message(&e)
        )
        .into(),
    }
}

fn dense(
    vb: &VarBuilder,
    inp: usize,
    out: usize,
    bias: bool,
    name: &str,
) -> candle_core::Result<Linear> {
    let l = if bias {
        candle_nn::linear(inp, out, vb.pp(name))?
    } else {
        candle_nn::linear_no_bias(inp, out, vb.pp(name))?
    };
    Ok(Linear::Dense(l))
}

/// What a Llama-shaped HF checkpoint (Llama, Mistral, Qwen2, Gemma, Gemma 2) does
/// differently; every family file turns its config into one of these.
#[derive(Debug, Clone)]
pub struct Recipe {
    /// [`ModelInfo::architecture`](crate::ModelInfo::architecture).
    pub architecture: &'static str,
    /// Biases on q/k/v (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Biases on the MLP projections.
    pub mlp_bias: bool,
    /// Activation of the MLP gate.
    pub act: candle_nn::Activation,
    /// RMSNorm weights are stored as `w` and applied as `1 + w` (Gemma).
    pub norm_plus_one: bool,
    /// Embeddings are multiplied by `sqrt(hidden)` (Gemma).
    pub embed_scale: bool,
    /// Norms after attention and MLP as well as before (Gemma 2).
    pub sandwich_norms: bool,
    /// Attention-logit soft-cap (Gemma 2).
    pub attn_softcap: Option<f64>,
    /// Final-logit soft-cap (Gemma 2).
    pub final_softcap: Option<f64>,
    /// Attention scale instead of `head_dim^-1/2` (Gemma 2's `query_pre_attn_scalar^-1/2`).
    pub scale: Option<f64>,
    /// Sliding window per layer.
    pub windows: Vec<Option<usize>>,
    /// RMSNorm on queries and keys per head, before RoPE (Gemma 3's `q_norm`/`k_norm`).
    pub qk_norm: bool,
    /// RoPE of the sliding-window layers where it differs from the global layers' (Gemma 3).
    pub local_rope: Option<crate::arch::rope::RopeConfig>,
}

impl Recipe {
    /// Plain Llama: biases as the config says, SiLU (or `hidden_act`), no window.
    pub fn llama(cfg: &LlamaConfig) -> Result<Self> {
        Ok(Self {
            architecture: "llama",
            qkv_bias: cfg.attention_bias,
            o_bias: cfg.attention_bias,
            mlp_bias: cfg.mlp_bias,
            act: activation(cfg.hidden_act.as_deref().unwrap_or("silu"), "hidden_act")?,
            norm_plus_one: false,
            embed_scale: false,
            sandwich_norms: false,
            attn_softcap: None,
            final_softcap: None,
            scale: None,
            windows: vec![None; cfg.num_hidden_layers],
            qk_norm: false,
            local_rope: None,
        })
    }
}

/// Builds a Llama-shaped model from HF-named weights (`model.layers.N.self_attn.q_proj.weight`,
/// …) as `recipe` says. `path` names the weights in error messages.
pub fn from_varbuilder(
    cfg: &LlamaConfig,
    recipe: &Recipe,
    vb: VarBuilder,
    path: &Path,
    source: &str,
) -> Result<Decoder> {
    cfg.validate()?;
    let err = weights_err(path);
    let (h, nh, nkv, hd) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.n_kv_heads(),
        cfg.head_dim(),
    );
    let rope_cfg = cfg.rope()?;
    let m = vb.pp("model");
    let embed = candle_nn::embedding(cfg.vocab_size, h, m.pp("embed_tokens")).map_err(&err)?;
    let norm_of = |vb: &VarBuilder, name: &str, h: usize| -> Result<Norm> {
        let mut w = vb.pp(name).get(h, "weight").map_err(&err)?;
        if recipe.norm_plus_one {
            w = (w + 1.0)?;
        }
        Ok(Norm::Rms(RmsNorm::new(w, cfg.rms_norm_eps)))
    };
    let norm_at = |vb: &VarBuilder, name: &str| norm_of(vb, name, h);
    // MLKV: the layer each attends over, and that layer's index among the KV layers.
    let sources = cfg.kv_sources()?;
    let mut kv_index = Vec::with_capacity(sources.len());
    let mut kv_layers = 0;
    for (i, &s) in sources.iter().enumerate() {
        if s == i {
            kv_layers += 1;
        }
        kv_index.push(kv_layers - 1); // layer 0 always projects K/V
    }
    let mut layers = Vec::new(); // the count was checked against the weights, not reserved
    for i in 0..cfg.num_hidden_layers {
        let l = m.pp(format!("layers.{i}"));
        let a = l.pp("self_attn");
        let mut spec = AttnSpec::new(nh, nkv, hd);
        spec.sliding_window = recipe.windows.get(i).copied().flatten();
        spec.softcap = recipe.attn_softcap;
        if let Some(s) = recipe.scale {
            spec.scale = s;
        }
        let qb = recipe.qkv_bias;
        let owner = sources[i];
        if spec.sliding_window != recipe.windows.get(owner).copied().flatten() {
            return Err(ModelError::config(
                "num_key_value_layers",
                format!("puts layer {i} on KV layer {owner}'s cache, but their sliding windows differ; layers sharing a cache must attend alike"),
            ));
        }
        // q first: a config whose sizes do not match the weights is named by q_proj.
        let q = dense(&a, h, nh * hd, qb, "q_proj").map_err(&err)?;
        let kv = if owner == i {
            Some(KvProjections {
                k: dense(&a, h, nkv * hd, qb, "k_proj").map_err(&err)?,
                v: dense(&a, h, nkv * hd, qb, "v_proj").map_err(&err)?,
                k_norm: recipe
                    .qk_norm
                    .then(|| norm_of(&a, "k_norm", hd))
                    .transpose()?,
            })
        } else {
            None
        };
        let attn = Attention {
            layer: kv_index[i],
            q,
            kv,
            o: dense(&a, nh * hd, h, recipe.o_bias, "o_proj").map_err(&err)?,
            rope: None, // below, once the weights have confirmed the head size
            q_norm: recipe
                .qk_norm
                .then(|| norm_of(&a, "q_norm", hd))
                .transpose()?,
            spec,
        };
        let p = l.pp("mlp");
        let (ff, mb) = (cfg.intermediate_size, recipe.mlp_bias);
        let mlp = Mlp::Gated {
            gate: dense(&p, h, ff, mb, "gate_proj").map_err(&err)?,
            up: dense(&p, h, ff, mb, "up_proj").map_err(&err)?,
            down: dense(&p, ff, h, mb, "down_proj").map_err(&err)?,
            act: recipe.act,
        };
        // Gemma 2 names its four norms differently: `post_attention_layernorm` follows
        // attention there, while in Llama it is the norm before the MLP.
        let block = if recipe.sandwich_norms {
            Block {
                attn_norm: norm_at(&l, "input_layernorm")?,
                attn,
                post_attn_norm: Some(norm_at(&l, "post_attention_layernorm")?),
                mlp_norm: norm_at(&l, "pre_feedforward_layernorm")?,
                mlp,
                post_mlp_norm: Some(norm_at(&l, "post_feedforward_layernorm")?),
            }
        } else {
            Block {
                attn_norm: norm_at(&l, "input_layernorm")?,
                attn,
                post_attn_norm: None,
                mlp_norm: norm_at(&l, "post_attention_layernorm")?,
                mlp,
                post_mlp_norm: None,
            }
        };
        layers.push(block);
    }
    // The rotary tables are sized by head_dim, which only the q/k/v shapes above vouch for
    // (a config's head_dim of 2^40 would otherwise ask for terabytes).
    let rope = Rope::new(&rope_cfg, hd, RopeStyle::Half);
    let local = recipe
        .local_rope
        .as_ref()
        .map(|c| Rope::new(c, hd, RopeStyle::Half));
    for b in &mut layers {
        let sliding = b.attn.spec.sliding_window.is_some();
        b.attn.rope = Some(match (&local, sliding) {
            (Some(l), true) => l.clone(),
            _ => rope.clone(),
        });
    }
    let norm = norm_at(&m, "norm")?;
    let tied = cfg
        .tie_word_embeddings
        .unwrap_or(recipe.architecture.starts_with("gemma"));
    let lm_head = if tied {
        Linear::Dense(candle_nn::Linear::new(embed.embeddings().clone(), None))
    } else if vb.contains_tensor("lm_head.weight") {
        dense(&vb, h, cfg.vocab_size, false, "lm_head").map_err(&err)?
    } else {
        return Err(untied_without_head());
    };
    let parts = DecoderParts {
        embed: Embedding::Dense(embed),
        embed_scale: recipe.embed_scale.then(|| (h as f64).sqrt()),
        positions: None,
        layers,
        norm: Some(norm),
        lm_head,
        final_softcap: recipe.final_softcap,
    };
    Decoder::new(
        parts,
        ModelIdentity {
            architecture: recipe.architecture.into(),
            source: source.to_string(),
            max_positions: cfg.max_position_embeddings,
            bos: TokenIds::first_of(&cfg.bos_token_id),
            eos: TokenIds::all_of(&cfg.eos_token_id),
            dtype: vb.dtype(),
            device: vb.device().clone(),
            conversion: cfg.lossy_conversion(),
        },
    )
}

/// An untied model (`tie_word_embeddings` false, or absent for a non-Gemma model) whose
/// weights lack `lm_head.weight`: refused rather than tied behind the config's back.
pub(crate) fn untied_without_head() -> ModelError {
    ModelError::config(
        "tie_word_embeddings",
        "is false (the LM head is a matrix of its own) but the weights hold no lm_head.weight; set it to true if the head shares the embeddings, or give the complete weights",
    )
}
