//! Damaged GGUF metadata: a copy of a fixture GGUF with one key or tensor changed is refused
//! with a message that names the key (or tensor), what was expected, and what to do — exit 1,
//! no panic, nothing written (`common::cli::fails_with`).
mod common;

use std::path::Path;

use anyhow::Result;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;
use common::cli::fails_with;

/// One change to the fixture file.
enum Edit {
    /// Sets (or adds) a metadata key.
    Set(&'static str, Value),
    /// Removes a metadata key.
    Drop(&'static str),
    /// Removes a tensor.
    DropTensor(&'static str),
}

/// Writes `tests/fixtures/gguf/llama_gqa.gguf` with `edit` applied to `to`.
fn edited(edit: &Edit, to: &Path) -> Result<()> {
    let src = common::fixture("gguf").join("llama_gqa.gguf");
    let mut reader = std::fs::File::open(&src)?;
    let content = gguf_file::Content::read(&mut reader)?;
    let mut meta: Vec<(String, Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    match edit {
        Edit::Set(key, value) => {
            meta.retain(|(k, _)| k != key);
            meta.push((key.to_string(), value.clone()));
        }
        Edit::Drop(key) => meta.retain(|(k, _)| k != key),
        Edit::DropTensor(_) => {}
    }
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for name in names {
        if matches!(edit, Edit::DropTensor(t) if t == name) {
            continue;
        }
        tensors.push((
            name.clone(),
            content.tensor(&mut reader, name, &Device::Cpu)?,
        ));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(to)?;
    gguf_file::write(&mut out, &meta_refs, &tensor_refs)?;
    Ok(())
}

#[test]
fn damaged_metadata_is_named() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let s = |x: &str| Value::String(x.into());
    let cases = [
        (
            Edit::Set("general.architecture", s("falcon")),
            // The supported ones, then the fix (issue 55's errors that teach).
            "has architecture `falcon`, which is not supported from GGUF; supported: llama, qwen2, gemma, gemma2, gemma3; use a GGUF of one of these, or the model's safetensors with --model-dir (config.json's model_type one of llama, mistral, qwen2, gemma, gemma2, gemma3_text, opt)",
        ),
        (Edit::Drop("general.architecture"), "has no `general.architecture` metadata"),
        (
            Edit::Drop("llama.attention.head_count"),
            "lacks the integer metadata `llama.attention.head_count`",
        ),
        (
            Edit::Set("llama.block_count", s("three")),
            "has `llama.block_count` = \"three\" (a string), expected a non-negative integer",
        ),
        (
            Edit::Set("llama.block_count", Value::I32(-3)),
            "has `llama.block_count` = -3, expected a non-negative integer",
        ),
        (
            Edit::Set("llama.attention.head_count", Value::U32(5)),
            "has inconsistent head counts (5 heads, 2 KV heads): the query heads must be a whole multiple of the KV heads",
        ),
        (
            Edit::Set("llama.attention.head_count_kv", Value::U32(0)),
            "(4 heads, 0 KV heads)",
        ),
        (
            Edit::Set("llama.embedding_length", Value::U32(65)),
            "token_embd.weight is 384×64 but the embedding width is 65",
        ),
        (
            Edit::Set("llama.rope.freq_base", Value::F32(f32::NAN)),
            "has llama.rope.freq_base = NaN; it must be a finite number > 0",
        ),
        (
            Edit::Set("llama.rope.freq_base", s("1e4")),
            "has `llama.rope.freq_base` = \"1e4\" (a string), expected a number",
        ),
        (
            Edit::Set("llama.attention.layer_norm_rms_epsilon", Value::F32(-1.0)),
            "has llama.attention.layer_norm_rms_epsilon = -1; it must be a finite number ≥ 0",
        ),
        (
            Edit::Set("llama.block_count", Value::U32(9)),
            "says llama.block_count = 9 but holds no blk.8.attn_q.weight",
        ),
        (
            Edit::Drop("tokenizer.ggml.tokens"),
            "lacks the string array `tokenizer.ggml.tokens`",
        ),
        (
            Edit::Set("tokenizer.ggml.model", s("rwkv")),
            "has a `rwkv` vocabulary; byte-level BPE (`gpt2`) and SentencePiece (`llama`) vocabularies are rebuilt from GGUF — pass the model's tokenizer.json with --tokenizer",
        ),
        (
            Edit::DropTensor("blk.1.ffn_down.weight"),
            "lacks the tensor `blk.1.ffn_down.weight`",
        ),
        (
            Edit::DropTensor("token_embd.weight"),
            "lacks the tensor `token_embd.weight`",
        ),
    ];
    for (i, (edit, needle)) in cases.iter().enumerate() {
        let f = dir.path().join(format!("case{i}.gguf"));
        edited(edit, &f)?;
        let f = f.to_string_lossy();
        fails_with(
            &["--gguf", &f, "--prompt", "t0 t1", "--max-new-tokens", "2"],
            needle,
        )?;
    }
    Ok(())
}
