//! The Llama family (Llama 2, Llama 3 with `llama3` RoPE scaling, SmolLM2): pre-norm
//! decoder blocks of RMSNorm → attention → RMSNorm → gated-SiLU MLP, from safetensors or
//! GGUF. Its HF weight layout is shared by Mistral, Qwen2 and Gemma (1 and 2): their files
//! describe what differs as a [`Recipe`] and build through [`from_varbuilder`].
use std::path::Path;

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use kvpolicy_core::AttnSpec;

use crate::attention::Attention;
use crate::config::{activation, LlamaConfig, TokenIds};
use crate::decoder::{Block, Decoder};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::layers::{Linear, Mlp, Norm, RmsNorm};
use crate::model::ModelInfo;
use crate::rope::{Rope, RopeStyle};

fn weights_err(path: &Path) -> impl Fn(candle_core::Error) -> ModelError + '_ {
    move |e| ModelError::Weights {
        path: path.to_path_buf(),
        message: format!(
            "{}; check that config.json belongs to these weights",
            crate::error::candle_message(&e)
        ),
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
    /// `ModelInfo::architecture`.
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
    pub local_rope: Option<crate::rope::RopeConfig>,
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
        let attn = Attention {
            layer: i,
            q: dense(&a, h, nh * hd, qb, "q_proj").map_err(&err)?,
            k: dense(&a, h, nkv * hd, qb, "k_proj").map_err(&err)?,
            v: dense(&a, h, nkv * hd, qb, "v_proj").map_err(&err)?,
            o: dense(&a, nh * hd, h, recipe.o_bias, "o_proj").map_err(&err)?,
            rope: None, // below, once the weights have confirmed the head size
            q_norm: recipe
                .qk_norm
                .then(|| norm_of(&a, "q_norm", hd))
                .transpose()?,
            k_norm: recipe
                .qk_norm
                .then(|| norm_of(&a, "k_norm", hd))
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
    let lm_head = if cfg.tie_word_embeddings || !vb.contains_tensor("lm_head.weight") {
        Linear::Dense(candle_nn::Linear::new(embed.embeddings().clone(), None))
    } else {
        dense(&vb, h, cfg.vocab_size, false, "lm_head").map_err(&err)?
    };
    let info = ModelInfo {
        architecture: recipe.architecture.into(),
        source: source.to_string(),
        vocab_size: cfg.vocab_size,
        max_positions: cfg.max_position_embeddings,
        n_layers: cfg.num_hidden_layers,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        hidden: h,
        intermediate: cfg.intermediate_size,
        dtype: vb.dtype(),
        device: vb.device().clone(),
        bos: TokenIds::first_of(&cfg.bos_token_id),
        eos: TokenIds::all_of(&cfg.eos_token_id),
    };
    Ok(Decoder {
        embed,
        embed_scale: recipe.embed_scale.then(|| (h as f64).sqrt()),
        positions: None,
        layers,
        norm: Some(norm),
        lm_head,
        final_softcap: recipe.final_softcap,
        info,
    })
}

/// Builds the model from a GGUF file of architecture `llama` (llama.cpp's tensor names,
/// quantized matmuls, adjacent-pair RoPE).
pub fn from_gguf(g: &GgufFile, device: &Device) -> Result<Decoder> {
    let arch = g.architecture()?;
    let key = |k: &str| format!("{arch}.{k}");
    let nh = g.meta_usize(&key("attention.head_count"))?;
    let nkv = g.meta_usize_or(&key("attention.head_count_kv"), nh)?;
    let n_layers = g.meta_usize(&key("block_count"))?;
    let h = g.meta_usize(&key("embedding_length"))?;
    let eps = g.meta_f64_or(&key("attention.layer_norm_rms_epsilon"), 1e-5)?;
    let theta = g.meta_f64_or(&key("rope.freq_base"), 10_000.0)?;
    let max_positions = g.meta_usize_or(&key("context_length"), 2048)?;
    if nh == 0 || nkv == 0 || nh % nkv != 0 || h % nh != 0 {
        return Err(g.corrupt(format!(
            "has inconsistent head counts ({nh} heads, {nkv} KV heads, width {h})"
        )));
    }
    if n_layers == 0 {
        return Err(g.corrupt(format!(
            "says {arch}.block_count = 0; a decoder needs at least one layer"
        )));
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(g.corrupt(format!(
            "has {arch}.attention.layer_norm_rms_epsilon = {eps}; it must be a finite number ≥ 0"
        )));
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(g.corrupt(format!(
            "has {arch}.rope.freq_base = {theta}; it must be a finite number > 0"
        )));
    }
    let hd = g.meta_usize_or(&key("rope.dimension_count"), h / nh)?;
    // Sizes in the metadata are checked against the tensors (whose bytes the file holds)
    // before anything is allocated from them.
    let (vocab, emb_w) = match g.tensor_dims("token_embd.weight")?.as_slice() {
        [v, w] => (*v, *w),
        other => {
            return Err(g.corrupt(format!(
                "token_embd.weight has dimensions {other:?}, expected 2"
            )))
        }
    };
    if emb_w != h {
        return Err(g.corrupt(format!(
            "token_embd.weight is {vocab}×{emb_w} but the embedding width is {h}"
        )));
    }
    if n_layers > 0 {
        let q = g.tensor_dims("blk.0.attn_q.weight")?;
        if q.get(1).copied() != Some(h) || hd.checked_mul(nh) != q.first().copied() {
            return Err(g.corrupt(format!(
                "blk.0.attn_q.weight has dimensions {q:?}, but {nh} heads × {hd} from a width of {h} were expected"
            )));
        }
    }
    let freq_factors = if g.has_tensor("rope_freqs.weight") {
        let t = g
            .tensor("rope_freqs.weight", &Device::Cpu)?
            .dequantize(&Device::Cpu)?;
        Some(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    } else {
        None
    };
    let rope_cfg = crate::rope::RopeConfig {
        theta,
        scaling: crate::rope::RopeScaling::None,
        freq_factors,
    };
    let rope = Rope::new(&rope_cfg, hd, RopeStyle::Interleaved);
    let embed_q = g.tensor("token_embd.weight", device)?;
    let embed = candle_nn::Embedding::new(embed_q.dequantize(device)?, h);
    let ql = |name: String, out: usize, inp: usize| -> Result<Linear> {
        let t = g.tensor(&name, device)?;
        if t.shape().dims() != [out, inp] {
            return Err(g.corrupt(format!(
                "{name} has shape {:?}, expected [{out}, {inp}]",
                t.shape().dims()
            )));
        }
        Ok(Linear::Quant {
            w: QMatMul::from_qtensor(t)?,
            bias: None,
            out,
            inp,
        })
    };
    let ffn = |g: &GgufFile, i: usize| -> Result<usize> {
        let name = format!("blk.{i}.ffn_up.weight");
        g.tensor_dims(&name).and_then(|d| {
            d.first()
                .copied()
                .ok_or_else(|| g.corrupt(format!("{name} has no dimensions")))
        })
    };
    let mut layers = Vec::new(); // n_layers comes from the file: no reservation
    let mut intermediate = None;
    for i in 0..n_layers {
        let ff = ffn(g, i)?;
        intermediate = Some(intermediate.unwrap_or(0).max(ff));
        let attn = Attention {
            layer: i,
            q: ql(format!("blk.{i}.attn_q.weight"), nh * hd, h)?,
            k: ql(format!("blk.{i}.attn_k.weight"), nkv * hd, h)?,
            v: ql(format!("blk.{i}.attn_v.weight"), nkv * hd, h)?,
            o: ql(format!("blk.{i}.attn_output.weight"), h, nh * hd)?,
            rope: Some(rope.clone()),
            q_norm: None,
            k_norm: None,
            spec: AttnSpec::new(nh, nkv, hd),
        };
        let mlp = Mlp::Gated {
            gate: ql(format!("blk.{i}.ffn_gate.weight"), ff, h)?,
            up: ql(format!("blk.{i}.ffn_up.weight"), ff, h)?,
            down: ql(format!("blk.{i}.ffn_down.weight"), h, ff)?,
            act: candle_nn::Activation::Silu,
        };
        let norm = |name: String| -> Result<Norm> {
            Ok(Norm::Rms(RmsNorm::new(g.dense(&name, device)?, eps)))
        };
        layers.push(Block {
            attn_norm: norm(format!("blk.{i}.attn_norm.weight"))?,
            attn,
            post_attn_norm: None,
            mlp_norm: norm(format!("blk.{i}.ffn_norm.weight"))?,
            mlp,
            post_mlp_norm: None,
        });
    }
    let norm = Norm::Rms(RmsNorm::new(g.dense("output_norm.weight", device)?, eps));
    let out_name = if g.has_tensor("output.weight") {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    let lm_head = ql(out_name.to_string(), vocab, h)?;
    let info = ModelInfo {
        architecture: arch.clone(),
        source: g.path().display().to_string(),
        vocab_size: vocab,
        max_positions,
        n_layers,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        hidden: h,
        intermediate: intermediate.unwrap_or(0),
        dtype: DType::F32,
        device: device.clone(),
        bos: g.meta_u32_opt("tokenizer.ggml.bos_token_id"),
        eos: g
            .meta_u32_opt("tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect(),
    };
    Ok(Decoder {
        embed,
        embed_scale: None,
        positions: None,
        layers,
        norm: Some(norm),
        lm_head,
        final_softcap: None,
        info,
    })
}
