//! The Llama family (Llama 2, Llama 3 with `llama3` RoPE scaling, SmolLM2): pre-norm
//! decoder blocks of RMSNorm → attention → RMSNorm → gated-SiLU MLP, from safetensors or
//! GGUF.
use std::path::Path;

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use kvpolicy_core::{AttnSpec, KvPolicy};

use crate::attention::Attention;
use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::layers::{GatedMlp, Linear, RmsNorm};
use crate::model::{CausalLm, LogitsMode, ModelInfo};
use crate::rope::{Rope, RopeStyle};

#[derive(Debug, Clone)]
struct Block {
    attn_norm: RmsNorm,
    attn: Attention,
    mlp_norm: RmsNorm,
    mlp: GatedMlp,
}

/// A Llama-family decoder.
#[derive(Debug, Clone)]
pub struct Llama {
    embed: candle_nn::Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    info: ModelInfo,
}

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

impl Llama {
    /// Builds the model from HF-named weights (`model.layers.N.self_attn.q_proj.weight`, …).
    /// `path` names the weights in error messages.
    pub fn from_varbuilder(
        cfg: &LlamaConfig,
        vb: VarBuilder,
        path: &Path,
        source: &str,
    ) -> Result<Self> {
        cfg.validate()?;
        let err = weights_err(path);
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.n_kv_heads(),
            cfg.head_dim(),
        );
        let rope = Rope::new(&cfg.rope()?, hd, RopeStyle::Half);
        let m = vb.pp("model");
        let embed = candle_nn::embedding(cfg.vocab_size, h, m.pp("embed_tokens")).map_err(&err)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = m.pp(format!("layers.{i}"));
            let a = l.pp("self_attn");
            let ab = cfg.attention_bias;
            let attn = Attention {
                layer: i,
                q: dense(&a, h, nh * hd, ab, "q_proj").map_err(&err)?,
                k: dense(&a, h, nkv * hd, ab, "k_proj").map_err(&err)?,
                v: dense(&a, h, nkv * hd, ab, "v_proj").map_err(&err)?,
                o: dense(&a, nh * hd, h, ab, "o_proj").map_err(&err)?,
                rope: Some(rope.clone()),
                spec: AttnSpec::new(nh, nkv, hd),
            };
            let p = l.pp("mlp");
            let mb = cfg.mlp_bias;
            let mlp = GatedMlp {
                gate: dense(&p, h, cfg.intermediate_size, mb, "gate_proj").map_err(&err)?,
                up: dense(&p, h, cfg.intermediate_size, mb, "up_proj").map_err(&err)?,
                down: dense(&p, cfg.intermediate_size, h, mb, "down_proj").map_err(&err)?,
            };
            let norm = |name: &str| -> Result<RmsNorm> {
                Ok(RmsNorm::new(
                    l.pp(name).get(h, "weight").map_err(&err)?,
                    cfg.rms_norm_eps,
                ))
            };
            layers.push(Block {
                attn_norm: norm("input_layernorm")?,
                attn,
                mlp_norm: norm("post_attention_layernorm")?,
                mlp,
            });
        }
        let norm = RmsNorm::new(
            m.pp("norm").get(h, "weight").map_err(&err)?,
            cfg.rms_norm_eps,
        );
        let lm_head = if cfg.tie_word_embeddings || !vb.contains_tensor("lm_head.weight") {
            Linear::Dense(candle_nn::Linear::new(embed.embeddings().clone(), None))
        } else {
            dense(&vb, h, cfg.vocab_size, false, "lm_head").map_err(&err)?
        };
        let info = ModelInfo {
            architecture: "llama".into(),
            source: source.to_string(),
            vocab_size: cfg.vocab_size,
            max_positions: cfg.max_position_embeddings,
            n_layers: cfg.num_hidden_layers,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            hidden: h,
            dtype: vb.dtype(),
            device: vb.device().clone(),
            bos: cfg
                .bos_token_id
                .as_ref()
                .and_then(|b| b.to_vec().first().copied()),
            eos: cfg
                .eos_token_id
                .as_ref()
                .map(|e| e.to_vec())
                .unwrap_or_default(),
        };
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
            info,
        })
    }

    /// Builds the model from a GGUF file of architecture `llama` (llama.cpp's tensor names,
    /// quantized matmuls, adjacent-pair RoPE).
    pub fn from_gguf(g: &GgufFile, device: &Device) -> Result<Self> {
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
        let hd = g.meta_usize_or(&key("rope.dimension_count"), h / nh)?;
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
        let (vocab, emb_w) = embed_q.shape().dims2()?;
        if emb_w != h {
            return Err(g.corrupt(format!(
                "token_embd.weight is {vocab}×{emb_w} but the embedding width is {h}"
            )));
        }
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
        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let ff = ffn(g, i)?;
            let attn = Attention {
                layer: i,
                q: ql(format!("blk.{i}.attn_q.weight"), nh * hd, h)?,
                k: ql(format!("blk.{i}.attn_k.weight"), nkv * hd, h)?,
                v: ql(format!("blk.{i}.attn_v.weight"), nkv * hd, h)?,
                o: ql(format!("blk.{i}.attn_output.weight"), h, nh * hd)?,
                rope: Some(rope.clone()),
                spec: AttnSpec::new(nh, nkv, hd),
            };
            let mlp = GatedMlp {
                gate: ql(format!("blk.{i}.ffn_gate.weight"), ff, h)?,
                up: ql(format!("blk.{i}.ffn_up.weight"), ff, h)?,
                down: ql(format!("blk.{i}.ffn_down.weight"), h, ff)?,
            };
            layers.push(Block {
                attn_norm: RmsNorm::new(
                    g.dense(&format!("blk.{i}.attn_norm.weight"), device)?,
                    eps,
                ),
                attn,
                mlp_norm: RmsNorm::new(g.dense(&format!("blk.{i}.ffn_norm.weight"), device)?, eps),
                mlp,
            });
        }
        let norm = RmsNorm::new(g.dense("output_norm.weight", device)?, eps);
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
            dtype: DType::F32,
            device: device.clone(),
            bos: g.meta_u32_opt("tokenizer.ggml.bos_token_id"),
            eos: g
                .meta_u32_opt("tokenizer.ggml.eos_token_id")
                .into_iter()
                .collect(),
        };
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
            info,
        })
    }
}

impl CausalLm for Llama {
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
        for block in &self.layers {
            let x = block.attn_norm.forward(&h)?;
            h = (h + block.attn.forward(&x, pos, policy)?)?;
            let x = block.mlp_norm.forward(&h)?;
            h = (h + block.mlp.forward(&x)?)?;
        }
        if mode == LogitsMode::Last && t > 1 {
            h = h.narrow(1, t - 1, 1)?;
        }
        let h = self.norm.forward(&h)?;
        Ok(self.lm_head.forward(&h)?.to_dtype(DType::F32)?)
    }
}
