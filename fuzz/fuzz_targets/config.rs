//! config.json from arbitrary bytes: parsing and every architecture's recipe must return
//! errors, never panic.
#![no_main]
use kvpolicy::models::config::ModelConfig;
use kvpolicy::models::llama::Recipe;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(cfg) = ModelConfig::from_json(&text) {
        let _ = match &cfg {
            ModelConfig::Llama(c) => c.validate().and_then(|()| Recipe::llama(c)).map(drop),
            ModelConfig::Mistral(c) => kvpolicy::models::mistral::recipe(c).map(drop),
            ModelConfig::Qwen2(c) => kvpolicy::models::qwen2::recipe(c).map(drop),
            ModelConfig::Gemma(c) => kvpolicy::models::gemma::recipe(c).map(drop),
            ModelConfig::Gemma2(c) => kvpolicy::models::gemma::recipe2(c).map(drop),
            ModelConfig::Opt(c) => c.validate(),
        };
    }
});
