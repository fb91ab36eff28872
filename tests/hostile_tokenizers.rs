//! Hostile tokenizer files (issue "Hardening III", items 5, 8–10): a pre-tokenizer regex
//! that backtracks past the engine's retry limit, a chat template of nested loops, and a
//! normalizer that multiplies its input are one-line errors, not a panic or a run that
//! grows until memory runs out; `--chat` without prompt text is a usage error.
mod common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use anyhow::{ensure, Result};
use serde_json::json;

/// A word-level tokenizer over a few words, with `normalizer` and `pre_tokenizer`.
fn tokenizer(normalizer: serde_json::Value, pre_tokenizer: serde_json::Value) -> String {
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "hi": 2}, "unk_token": "[UNK]"}
    })
    .to_string()
}

/// The llama_gqa fixture with `tokenizer.json` and, if given, a chat template.
fn model_dir(tok: &str, chat_template: Option<&str>) -> Result<tempfile::TempDir> {
    let d = common::copy_fixture("llama_gqa")?;
    std::fs::write(d.path().join("tokenizer.json"), tok)?;
    if let Some(t) = chat_template {
        std::fs::write(
            d.path().join("tokenizer_config.json"),
            json!({"chat_template": t}).to_string(),
        )?;
    }
    Ok(d)
}

/// Runs the llama example on `dir`, killed after two minutes.
fn run(dir: &Path, extra: &[&str]) -> Result<Output> {
    let mut cmd = std::process::Command::new(common::example_bin("llama"));
    cmd.arg("--model-dir")
        .arg(dir)
        .args(["--max-new-tokens", "2"])
        .args(extra)
        .env("HF_HUB_OFFLINE", "1");
    common::cli::output_within(&mut cmd, Duration::from_secs(120))
}

#[test]
fn a_plain_tokenizer_works() -> Result<()> {
    let d = model_dir(&tokenizer(json!(null), json!({"type": "Whitespace"})), None)?;
    let o = run(d.path(), &["--prompt", "hi a"])?;
    ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    Ok(())
}

#[test]
fn a_backtracking_regex_is_an_error_not_a_panic() -> Result<()> {
    let split = json!({"type": "Split", "pattern": {"Regex": "(a|aa)+(a|aa)+b"},
        "behavior": "Isolated", "invert": false});
    let d = model_dir(&tokenizer(json!(null), split), None)?;
    let text = format!("{}c", "a".repeat(5000));
    let o = run(d.path(), &["--prompt", &text])?;
    common::cli::one_line_error(&o, false, &["encoding the text failed"])
}

#[test]
fn an_expanding_normalizer_is_refused_before_it_runs() -> Result<()> {
    let step = json!({"type": "Replace", "pattern": {"String": "a"}, "content": "a".repeat(1000)});
    let normalizer = json!({"type": "Sequence", "normalizers": [step, step, step, step]});
    let d = model_dir(&tokenizer(normalizer, json!({"type": "Whitespace"})), None)?;
    let o = run(d.path(), &["--prompt", "a a a a"])?;
    common::cli::one_line_error(&o, false, &["normalizer", "`Replace`", "1000×"])
}

#[test]
fn a_chat_template_of_nested_loops_runs_out_of_fuel() -> Result<()> {
    let template =
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
    let d = model_dir(
        &tokenizer(json!(null), json!({"type": "Whitespace"})),
        Some(template),
    )?;
    let o = run(d.path(), &["--prompt", "hi", "--chat"])?;
    common::cli::one_line_error(&o, false, &["chat template failed", "fuel"])
}

#[test]
fn a_chat_template_that_writes_without_end_is_stopped_at_its_cap() -> Result<()> {
    // Cheap in fuel (a few instructions a pass), 100 MB of output.
    let template = "{% set x = 'y' * 1000 %}{% for i in range(100000) %}{{ x }}{% endfor %}";
    let d = model_dir(
        &tokenizer(json!(null), json!({"type": "Whitespace"})),
        Some(template),
    )?;
    let o = run(d.path(), &["--prompt", "hi", "--chat"])?;
    common::cli::one_line_error(&o, false, &["chat template rendered more than 64 MiB"])
}

#[test]
fn chat_without_prompt_text_is_a_usage_error() -> Result<()> {
    let d = model_dir(&tokenizer(json!(null), json!({"type": "Whitespace"})), None)?;
    for extra in [
        &["--chat", "--prompt-ids", "1,2"][..],
        &["--chat", "--random-prompt", "3"][..],
    ] {
        let o = run(d.path(), extra)?;
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(o.status.code() == Some(2), "{extra:?}: {err}");
        ensure!(err.contains("--chat"), "{extra:?}: {err}");
    }
    Ok(())
}
