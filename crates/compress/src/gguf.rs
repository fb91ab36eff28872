//! A GGUF file as an HF checkpoint: every tensor dequantized to f32 and renamed from
//! llama.cpp's names (`blk.N.attn_q.weight`) to HF's (`model.layers.N.self_attn.q_proj.weight`),
//! the query and key rows of `llama` files put back in HF's order (llama.cpp's converter
//! interleaves each head's halves so that RoPE rotates adjacent pairs), `config.json` written
//! from the metadata, and the vocabulary rebuilt as `tokenizer.json` (as the examples read
//! GGUF vocabularies) with the chat template in `tokenizer_config.json`.
use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use kvpolicy_models::load::gguf::hparams::Hparams;
use kvpolicy_models::load::gguf::rules::rope_scaling;
use kvpolicy_models::{GgufFile, TextTokenizer};
use serde_json::{json, Map, Value};

use crate::checkpoint::{Checkpoint, NamedFile};
use crate::error::{CompressError, Result};

/// `(llama.cpp name, HF name)` of one layer's tensors; `{i}` is the layer.
const LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// Rows of each of `heads` heads back from llama.cpp's interleaved order (row `2i + s` of a
/// head) to HF's halves (row `s · d/2 + i`), for a weight `(heads · d, in)` or a bias.
fn unpermute(t: &Tensor, heads: usize, head_dim: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rest: usize = dims[1..].iter().product();
    let r = t
        .reshape((heads, head_dim / 2, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?;
    Ok(r)
}

/// `path`'s config.json as the metadata gives it, with no tensor read: what the settings are
/// checked against before any work.
pub fn header(path: &Path) -> Result<Checkpoint> {
    let g = GgufFile::open(path)?;
    Ok(Checkpoint {
        config: config_of(&g, path)?,
        tensors: BTreeMap::new(),
        files: Vec::new(),
    })
}

/// config.json from `g`'s metadata (architecture and RoPE checked).
fn config_of(g: &GgufFile, path: &Path) -> Result<Map<String, Value>> {
    let hp = Hparams::read(g)?;
    let (model_type, class) = match hp.arch.as_str() {
        "llama" => ("llama", "LlamaForCausalLM"),
        "qwen2" => ("qwen2", "Qwen2ForCausalLM"),
        other => {
            return Err(CompressError::Unsupported(format!(
                "{}: GGUF architecture `{other}` cannot be converted; kvpolicy-compress reads `llama` (Llama, SmolLM2, Mistral) and `qwen2` GGUF files",
                path.display()
            )))
        }
    };
    if g.has_tensor("rope_freqs.weight")
        || !matches!(
            rope_scaling(g, &hp.arch)?,
            kvpolicy_models::arch::rope::RopeScaling::None
        )
    {
        return Err(CompressError::Unsupported(format!(
            "{}: scaled RoPE is not carried over from GGUF; convert the model's HF directory with --model-dir",
            path.display()
        )));
    }
    let ffn = g.tensor_dims("blk.0.ffn_gate.weight")?;
    let intermediate = ffn
        .iter()
        .copied()
        .find(|&d| d != hp.hidden)
        .unwrap_or(hp.hidden);
    let tied = !g.has_tensor("output.weight");
    let mut config = Map::new();
    let mut set = |k: &str, v: Value| {
        config.insert(k.to_string(), v);
    };
    set("architectures", json!([class]));
    set("model_type", json!(model_type));
    set("hidden_size", json!(hp.hidden));
    set("intermediate_size", json!(intermediate));
    set("num_hidden_layers", json!(hp.n_layers));
    set("num_attention_heads", json!(hp.n_heads));
    set("num_key_value_heads", json!(hp.n_kv_heads));
    set("head_dim", json!(hp.head_dim));
    set("vocab_size", json!(hp.vocab));
    set("rms_norm_eps", json!(hp.eps));
    set("rope_theta", json!(hp.theta));
    set("max_position_embeddings", json!(hp.max_positions));
    set("tie_word_embeddings", json!(tied));
    set("hidden_act", json!("silu"));
    set("torch_dtype", json!("float32"));
    if model_type == "qwen2" {
        set("use_sliding_window", json!(false));
    }
    if let Some(b) = g.meta_u32_opt("tokenizer.ggml.bos_token_id") {
        set("bos_token_id", json!(b));
    }
    if let Some(e) = g.meta_u32_opt("tokenizer.ggml.eos_token_id") {
        set("eos_token_id", json!(e));
    }
    Ok(config)
}

/// Reads `path` as an HF checkpoint (see the module docs).
pub fn from_gguf(path: &Path) -> Result<Checkpoint> {
    let g = GgufFile::open(path)?;
    let config = config_of(&g, path)?;
    let hp = Hparams::read(&g)?;
    let cpu = Device::Cpu;
    let dense = |name: &str| -> Result<Tensor> { Ok(g.dense(name, &cpu)?) };
    let mut tensors = BTreeMap::new();
    tensors.insert(
        "model.embed_tokens.weight".to_string(),
        dense("token_embd.weight")?,
    );
    tensors.insert(
        "model.norm.weight".to_string(),
        dense("output_norm.weight")?,
    );
    if g.has_tensor("output.weight") {
        tensors.insert("lm_head.weight".to_string(), dense("output.weight")?);
    }
    let permuted = hp.arch == "llama";
    for i in 0..hp.n_layers {
        for (src, dst) in LAYER_NAMES {
            let name = format!("blk.{i}.{src}");
            if !g.has_tensor(&name) {
                if src.ends_with(".bias") {
                    continue;
                }
                return Err(CompressError::Checkpoint(format!(
                    "{}: holds no `{name}`",
                    path.display()
                )));
            }
            let mut t = dense(&name)?;
            if permuted && src.starts_with("attn_q") {
                t = unpermute(&t, hp.n_heads, hp.head_dim)?;
            } else if permuted && src.starts_with("attn_k") {
                t = unpermute(&t, hp.n_kv_heads, hp.head_dim)?;
            }
            tensors.insert(format!("model.layers.{i}.{dst}"), t);
        }
    }
    let bos = g.meta_u32_opt("tokenizer.ggml.bos_token_id");
    Ok(Checkpoint {
        config,
        tensors,
        files: tokenizer_files(&g, bos)?,
    })
}

/// `tokenizer.json` rebuilt from the vocabulary (with a post-processor adding BOS where the
/// file asks for it) and `tokenizer_config.json` with the chat template and special tokens.
fn tokenizer_files(g: &GgufFile, bos: Option<u32>) -> Result<Vec<NamedFile>> {
    let tok = TextTokenizer::from_gguf(g)?;
    let mut inner = tok.inner().clone();
    let tokens = g.meta_strings("tokenizer.ggml.tokens")?;
    let text_of = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize).cloned());
    let add_bos = g.meta_bool("tokenizer.ggml.add_bos_token").unwrap_or(false);
    if let (true, Some(id), Some(text)) = (add_bos, bos, text_of(bos)) {
        let post = tokenizers::processors::template::TemplateProcessing::builder()
            .try_single(format!("{text} $A"))
            .and_then(|b| {
                b.special_tokens(vec![(text.clone(), id)])
                    .build()
                    .map_err(|e| e.to_string())
            })
            .map_err(|e| CompressError::Checkpoint(format!("cannot rebuild BOS handling: {e}")))?;
        inner.with_post_processor(Some(post));
    }
    let json = inner
        .to_string(true)
        .map_err(|e| CompressError::Checkpoint(format!("cannot write tokenizer.json: {e}")))?;
    let mut cfg = Map::new();
    if let Some(t) = g.meta_str("tokenizer.chat_template") {
        cfg.insert("chat_template".into(), json!(t));
    }
    if let Some(t) = text_of(bos) {
        cfg.insert("bos_token".into(), json!(t));
    }
    if let Some(t) = text_of(g.meta_u32_opt("tokenizer.ggml.eos_token_id")) {
        cfg.insert("eos_token".into(), json!(t));
    }
    cfg.insert("add_bos_token".into(), json!(add_bos));
    let cfg = serde_json::to_vec_pretty(&Value::Object(cfg))
        .map_err(|e| CompressError::Checkpoint(e.to_string()))?;
    Ok(vec![
        NamedFile {
            name: "tokenizer.json".into(),
            bytes: json.into_bytes(),
        },
        NamedFile {
            name: "tokenizer_config.json".into(),
            bytes: cfg,
        },
    ])
}
