//! A safetensors file from arbitrary bytes beside a valid config.json: loading must return
//! errors, never panic.
#![no_main]
use candle_core::{DType, Device};
use kvpolicy::models::{load, resolve, ModelSpec};
use libfuzzer_sys::fuzz_target;

const CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
 "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
 "vocab_size": 16, "max_position_embeddings": 32}"#;

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("kvpolicy-fuzz-st-{}", std::process::id()));
    if std::fs::create_dir_all(&dir).is_err()
        || std::fs::write(dir.join("config.json"), CONFIG).is_err()
        || std::fs::write(dir.join("model.safetensors"), data).is_err()
    {
        return;
    }
    if let Ok(files) = resolve(&ModelSpec::Dir(dir.clone())) {
        let _ = load(&files, &Device::Cpu, DType::F32, None);
    }
});
