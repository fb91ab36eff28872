//! OPT (125M, 1.3B … 66B layout): learned absolute positions read at `position + 2`,
//! LayerNorm with bias before attention and MLP, biases on every projection, a ReLU MLP
//! (`fc1`, `fc2`), multi-head attention without a positional rotation, tied embeddings.
//! OPT-350M's post-norm layout and embedding projections are rejected with an error naming
//! the field (see [`OptConfig::validate`]).
use std::path::Path;

use candle_nn::VarBuilder;
use kvpolicy_core::AttnSpec;

use crate::arch::attention::{Attention, KvProjections};
use crate::arch::decoder::{Block, Decoder, DecoderParts, LearnedPositions, ModelIdentity};
use crate::arch::layers::{Embedding, Linear, Mlp, Norm};
use crate::config::{activation, OptConfig, TokenIds};
use crate::error::{ModelError, Result};

/// Row of the position table that position 0 reads (a quirk of the original fairseq code).
pub const POSITION_OFFSET: usize = 2;

/// Builds OPT from HF-named weights (`model.decoder.layers.N.self_attn.q_proj.weight`, …).
pub fn from_varbuilder(
    cfg: &OptConfig,
    vb: VarBuilder,
    path: &Path,
    source: &str,
) -> Result<Decoder> {
    cfg.validate()?;
    let err = |e: candle_core::Error| ModelError::Weights {
        path: path.to_path_buf(),
        message: format!(
            "{}; check that config.json belongs to these weights",
            crate::error::candle_message(&e)
        )
        .into(),
    };
    let (h, nh) = (cfg.hidden_size, cfg.num_attention_heads);
    let hd = h / nh;
    let bias = cfg.enable_bias;
    let linear = |vb: &VarBuilder, i: usize, o: usize, name: &str| -> Result<Linear> {
        let l = if bias {
            candle_nn::linear(i, o, vb.pp(name))
        } else {
            candle_nn::linear_no_bias(i, o, vb.pp(name))
        };
        Ok(Linear::Dense(l.map_err(err)?))
    };
    let ln = |vb: &VarBuilder, name: &str| -> Result<Norm> {
        Ok(Norm::Layer(
            candle_nn::layer_norm(h, 1e-5, vb.pp(name)).map_err(err)?,
        ))
    };
    let act = activation(&cfg.activation_function, "activation_function")?;
    let d = vb.pp("model").pp("decoder");
    let embed = candle_nn::embedding(cfg.vocab_size, h, d.pp("embed_tokens")).map_err(err)?;
    let table = candle_nn::embedding(
        cfg.max_position_embeddings + POSITION_OFFSET,
        h,
        d.pp("embed_positions"),
    )
    .map_err(err)?;
    let mut layers = Vec::new(); // the count was checked against the weights, not reserved
    for i in 0..cfg.num_hidden_layers {
        let l = d.pp(format!("layers.{i}"));
        let a = l.pp("self_attn");
        let attn = Attention {
            layer: i,
            q: linear(&a, h, h, "q_proj")?,
            kv: Some(KvProjections {
                k: linear(&a, h, h, "k_proj")?,
                v: linear(&a, h, h, "v_proj")?,
                k_norm: None,
            }),
            o: linear(&a, h, h, "out_proj")?,
            rope: None,
            q_norm: None,
            spec: AttnSpec::new(nh, nh, hd),
        };
        layers.push(Block {
            attn_norm: ln(&l, "self_attn_layer_norm")?,
            attn,
            post_attn_norm: None,
            mlp_norm: ln(&l, "final_layer_norm")?,
            mlp: Mlp::Plain {
                fc1: linear(&l, h, cfg.ffn_dim, "fc1")?,
                fc2: linear(&l, cfg.ffn_dim, h, "fc2")?,
                act,
            },
            post_mlp_norm: None,
        });
    }
    let norm = if cfg.remove_final_layer_norm {
        None
    } else {
        Some(ln(&d, "final_layer_norm")?)
    };
    let lm_head = if cfg.tie_word_embeddings {
        Linear::Dense(candle_nn::Linear::new(embed.embeddings().clone(), None))
    } else if !vb.contains_tensor("lm_head.weight") {
        return Err(crate::arch::llama::untied_without_head());
    } else {
        Linear::Dense(candle_nn::linear_no_bias(h, cfg.vocab_size, vb.pp("lm_head")).map_err(err)?)
    };
    let parts = DecoderParts {
        embed: Embedding::Dense(embed),
        embed_scale: None,
        positions: Some(LearnedPositions {
            table,
            offset: POSITION_OFFSET,
        }),
        layers,
        norm,
        lm_head,
        final_softcap: None,
    };
    Decoder::new(
        parts,
        ModelIdentity {
            architecture: "opt".into(),
            source: source.to_string(),
            max_positions: cfg.max_position_embeddings,
            bos: TokenIds::first_of(&cfg.bos_token_id),
            eos: TokenIds::all_of(&cfg.eos_token_id),
            dtype: vb.dtype(),
            device: vb.device().clone(),
            conversion: None,
        },
    )
}
