//! Generated model directories for the model-directory fuzz: a fixture's config, weights,
//! tokenizer and chat template, each axis left alone or made hostile by the generator — not
//! byte mutations, but the values, tensors and patterns that break loaders.
use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::common::Rng;

/// What a case did to the weights, for the checks that follow the run.
#[derive(Debug, Clone, PartialEq)]
pub enum WeightChange {
    /// Left as they were.
    None,
    /// A NaN or an infinity in a float tensor: a run must not succeed.
    NonFinite(String),
    /// A tensor held twice, a parameter stored as integers, the LM head removed from an
    /// untied model: a run must not succeed.
    Refused(String),
    /// Something else (a dtype, a shape, a truncation): any clean outcome.
    Other(String),
}

/// The fixtures a case starts from, with the example that runs each.
pub const FIXTURES: &[(&str, &str)] = &[
    ("llama_gqa", "llama"),
    ("mistral", "mistral"),
    ("qwen2", "qwen"),
    ("gemma2", "gemma"),
    ("gemma3", "gemma"),
    ("opt", "opt"),
];

/// A hostile value for a config field.
fn config_value(rng: &mut Rng) -> Value {
    let v = [
        json!(0),
        json!(-1),
        json!(1e39),
        json!(1e-46),
        json!(1e300),
        json!(-1e-5),
        json!(u64::MAX),
        json!(1u64 << 40),
        json!(1u64 << 62),
        json!(1.5),
        json!("NaN"),
        json!(null),
        json!([]),
        json!({"rope_type": "linear", "factor": 0.0}),
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
               "high_freq_factor": 1.0, "original_max_position_embeddings": 0}),
        json!(["sliding_attention"]),
        json!(true),
    ];
    v[rng.below(v.len())].clone()
}

const FIELDS: &[&str] = &[
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "ffn_dim",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rms_norm_eps",
    "sliding_window",
    "layer_types",
    "tie_word_embeddings",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "rope_local_base_freq",
    "hidden_activation",
    "model_type",
];

/// Makes the config hostile in up to two fields (or leaves it).
pub fn config(rng: &mut Rng, dir: &Path) -> Result<()> {
    if rng.chance(3) {
        return Ok(());
    }
    let p = dir.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p)?)?;
    for _ in 0..1 + rng.below(2) {
        c[rng.pick(FIELDS)] = config_value(rng);
    }
    std::fs::write(p, c.to_string())?;
    Ok(())
}

/// `t` with one element set to `x`.
fn poisoned(t: &Tensor, x: f32, rng: &mut Rng) -> Result<Tensor> {
    let mut v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let i = rng.below(v.len());
    v[i] = x;
    Ok(Tensor::from_vec(v, t.shape(), &Device::Cpu)?.to_dtype(t.dtype())?)
}

/// Makes the weights hostile in one way (or leaves them); says how.
pub fn weights(rng: &mut Rng, dir: &Path) -> Result<WeightChange> {
    let path = dir.join("model.safetensors");
    let mut t: HashMap<String, Tensor> = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let mut names: Vec<String> = t.keys().cloned().collect();
    names.sort();
    let name = names[rng.below(names.len())].clone();
    let change = match rng.below(9) {
        0 | 1 => return Ok(WeightChange::None),
        2 => {
            let x = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.below(3)];
            t.insert(name.clone(), poisoned(&t[&name], x, rng)?);
            // Named at load, whichever tensor it is in.
            WeightChange::NonFinite(name)
        }
        3 => {
            let other: HashMap<String, Tensor> = [(name.clone(), t[&name].clone())].into();
            candle_core::safetensors::save(&other, dir.join("zz-second.safetensors"))?;
            WeightChange::Refused(format!("{name} twice"))
        }
        4 if name.ends_with(".weight") || name.ends_with(".bias") => {
            let w = t[&name].to_dtype(DType::I64)?;
            t.insert(name.clone(), w);
            WeightChange::Refused(format!("{name} as I64"))
        }
        5 => {
            t.remove(&name);
            WeightChange::Other(format!("{name} removed"))
        }
        6 => {
            let w = t[&name].to_dtype([DType::F16, DType::BF16, DType::U8][rng.below(3)])?;
            t.insert(name.clone(), w);
            WeightChange::Other(format!("{name} retyped"))
        }
        7 => {
            let w = t[&name].flatten_all()?;
            t.insert(name.clone(), w);
            WeightChange::Other(format!("{name} flattened"))
        }
        _ => {
            candle_core::safetensors::save(&t, &path)?;
            let bytes = std::fs::read(&path)?;
            std::fs::write(&path, &bytes[..rng.below(bytes.len())])?;
            return Ok(WeightChange::Other("truncated".into()));
        }
    };
    candle_core::safetensors::save(&t, &path)?;
    Ok(change)
}

/// A tokenizer.json (or none): plain, or with a hostile normalizer, pattern or vocabulary.
pub fn tokenizer(rng: &mut Rng, dir: &Path) -> Result<bool> {
    if rng.chance(3) {
        return Ok(false);
    }
    let vocab: serde_json::Map<String, Value> = ["[UNK]", "a", "hi", "b", "the", "capital"]
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), json!(i)))
        .collect();
    let many = "x".repeat(1 + rng.below(2000));
    let normalizer = match rng.below(6) {
        0 => json!({"type": "Sequence", "normalizers": [
            {"type": "Replace", "pattern": {"String": "a"}, "content": many},
            {"type": "Replace", "pattern": {"String": "x"}, "content": many},
            {"type": "Replace", "pattern": {"Regex": ""}, "content": "yy"}]}),
        1 => json!({"type": "NFKC"}),
        2 => json!({"type": "Prepend", "prepend": many}),
        _ => Value::Null,
    };
    let pre = match rng.below(5) {
        0 => json!({"type": "Split", "pattern": {"Regex": "(a|aa)+(a|aa)+b"},
                    "behavior": "Isolated", "invert": false}),
        1 => json!({"type": "Split", "pattern": {"Regex": "(("}, "behavior": "Isolated",
                    "invert": false}),
        _ => json!({"type": "Whitespace"}),
    };
    let mut vocab = Value::Object(vocab);
    if rng.chance(4) {
        vocab["huge"] = json!(u32::MAX);
    }
    let tok = json!({"version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [], "normalizer": normalizer, "pre_tokenizer": pre,
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}});
    let text = if rng.chance(10) {
        "{not json".to_string()
    } else {
        tok.to_string()
    };
    std::fs::write(dir.join("tokenizer.json"), text)?;
    Ok(true)
}

/// A tokenizer_config.json with a chat template (or none): plain or hostile.
pub fn template(rng: &mut Rng, dir: &Path) -> Result<()> {
    let t = match rng.below(7) {
        0 => "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>",
        1 => "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        2 => "{{ raise_exception('no') }}",
        3 => "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
        4 => "{{ 'x' * 1000000000 }}",
        5 => "{{ messages[0].content | upper }}{{ undefined_thing.x.y }}",
        _ => return Ok(()),
    };
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"chat_template": t, "bos_token": "<s>", "eos_token": "</s>"}).to_string(),
    )?;
    Ok(())
}
