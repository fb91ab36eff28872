//! A GGUF file from arbitrary bytes: opening it, building the model and the tokenizer must
//! return errors, never panic or allocate more than the file can describe.
#![no_main]
use candle_core::Device;
use kvpolicy::models::{GgufFile, TextTokenizer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("kvpolicy-fuzz-{}.gguf", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(g) = GgufFile::open(&path) {
        let _ = kvpolicy::models::llama::from_gguf(&g, &Device::Cpu);
        let _ = TextTokenizer::from_gguf(&g);
    }
    let _ = std::fs::remove_file(&path);
});
