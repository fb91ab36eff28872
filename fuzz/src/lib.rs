//! The fuzz targets' bodies, shared by `cargo fuzz` (fuzz_targets/) and by the smoke run in
//! the workspace tests (tests/fuzz_smoke.rs includes this file), so that the README's test
//! command replays seeds, regressions and random mutations through the same code.
//!
//! Each function takes arbitrary bytes and must return normally: errors are fine, panics
//! and allocations sized by a field of the input (rather than its length) are bugs.
use candle_core::{DType, Device, Tensor};
use kvpolicy::models::arch::llama::Recipe;
use kvpolicy::models::config::ModelConfig;
use kvpolicy::models::{load, resolve, GgufFile, ModelSpec, TextTokenizer};
use kvpolicy::{build_policy, AttnSpec, AttnStep, KvRegen, PolicyOptions};

/// config.json text: parsing and every architecture's recipe.
pub fn config(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(cfg) = ModelConfig::from_json(&text) {
        let _ = match &cfg {
            ModelConfig::Llama(c) => c.validate().and_then(|()| Recipe::llama(c)).map(drop),
            ModelConfig::Mistral(c) => kvpolicy::models::arch::mistral::recipe(c).map(drop),
            ModelConfig::Qwen2(c) => kvpolicy::models::arch::qwen2::recipe(c).map(drop),
            ModelConfig::Gemma(c) => kvpolicy::models::arch::gemma::recipe(c).map(drop),
            ModelConfig::Gemma2(c) => kvpolicy::models::arch::gemma::recipe2(c).map(drop),
            ModelConfig::Gemma3(c) => kvpolicy::models::arch::gemma::recipe3(c).map(drop),
            ModelConfig::Opt(c) => c.validate(),
        };
    }
}

fn scratch(name: &str) -> std::path::PathBuf {
    let t = std::thread::current().id();
    std::env::temp_dir().join(format!("kvpolicy-fuzz-{}-{t:?}-{name}", std::process::id()))
}

/// A GGUF file: opening it, building the model and the tokenizer.
pub fn gguf(data: &[u8]) {
    let path = scratch("model.gguf");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(g) = GgufFile::open(&path) {
        let _ = kvpolicy::models::load::gguf::build::from_gguf(&g, &Device::Cpu);
        let _ = TextTokenizer::from_gguf(&g);
    }
    let _ = std::fs::remove_file(&path);
}

const ST_CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
 "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
 "vocab_size": 16, "max_position_embeddings": 32}"#;

/// A safetensors file beside a valid config.json: loading the model.
pub fn safetensors(data: &[u8]) {
    let dir = scratch("st");
    if std::fs::create_dir_all(&dir).is_err()
        || std::fs::write(dir.join("config.json"), ST_CONFIG).is_err()
        || std::fs::write(dir.join("model.safetensors"), data).is_err()
    {
        return;
    }
    if let Ok(files) = resolve(&ModelSpec::Dir(dir.clone())) {
        let _ = load(&files, &Device::Cpu, DType::F32, None);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

struct Regen;
impl KvRegen for Regen {
    fn regen(&self, x: &Tensor, _pos: usize) -> kvpolicy::core::Result<(Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let z = Tensor::zeros((b, 2, t, 4), DType::F32, x.device())?;
        Ok((z.clone(), z))
    }
    fn flops_per_token(&self) -> u64 {
        1
    }
}

/// A sequence of attention steps (any layer, position, chunk and window; shapes that may
/// not fit) and resets against one policy chosen by the first byte.
pub fn policy_ops(data: &[u8]) {
    let Some((&first, ops)) = data.split_first() else {
        return;
    };
    let mut opts = PolicyOptions {
        grow_tokens: 1 + (first as usize % 5),
        ..PolicyOptions::default()
    };
    if first & 16 != 0 {
        opts.device_kv_budget = Some(64 * first as u64);
    }
    // hybrid: blocks of 1–4 tokens, a forced share or a fixed profile (no timing here).
    opts.profile = Some(kvpolicy::Profile {
        h2d_bytes_per_s: 1e9,
        recompute_tokens_per_s: 1e6,
        device: None,
        shape: None,
    });
    // Each policy's settings from the same byte: a head group, a forced split, a block
    // size and a forced KV share.
    let group = 1 + (first as usize >> 6);
    let split = if first & 8 != 0 {
        format!("recompute:split={}", first as usize % 7)
    } else {
        "recompute".to_string()
    };
    let block = 1 + (first as usize >> 5) % 4;
    let hybrid = match (first & 32 != 0).then_some(f64::from(first % 3) / 2.0) {
        Some(r) => format!("hybrid:block_size={block},kv_act_ratio={r}"),
        None => format!("hybrid:block_size={block}"),
    };
    let specs = [
        "full".to_string(),
        "layer".to_string(),
        format!("headwise:group={group}"),
        split,
        hybrid,
    ];
    let Ok(mut p) = build_policy(&specs[first as usize % specs.len()], &opts) else {
        return;
    };
    let dev = Device::Cpu;
    let mut spec = AttnSpec::new(4, 2, 4);
    for op in ops.chunks(3) {
        let (a, b, c) = (
            op[0],
            op.get(1).copied().unwrap_or(0),
            op.get(2).copied().unwrap_or(0),
        );
        if a == 255 {
            p.reset();
            continue;
        }
        if a == 254 {
            match p.as_batched() {
                Some(batched) => batched.release(b as usize % 3),
                None => p.reset(),
            }
            continue;
        }
        spec.sliding_window = if c & 1 == 1 {
            Some(1 + (c as usize >> 1) % 6)
        } else {
            None
        };
        let t = 1 + (a as usize % 4);
        let nkv = if c & 128 != 0 { 1 } else { 2 };
        let (layer, pos) = ((b as usize) % 3, (b as usize >> 2) % 40);
        let (Ok(q), Ok(k), Ok(v), Ok(x)) = (
            Tensor::ones((1, 4, t, 4), DType::F32, &dev),
            Tensor::ones((1, nkv, t, 4), DType::F32, &dev),
            Tensor::ones((1, nkv, t, 4), DType::F32, &dev),
            Tensor::ones((1, t, 16), DType::F32, &dev),
        ) else {
            return;
        };
        let seq = if p.as_batched().is_some() {
            (c as usize >> 5) % 3
        } else {
            0
        };
        let _ = p.attend(&AttnStep {
            seq,
            layer,
            q: &q,
            k: &k,
            v: &v,
            x: &x,
            pos,
            spec: &spec,
            regen: &Regen,
        });
        let _ = p.stats();
    }
}
