//! Hostile tokenizer files (issue "Hardening III", items 5, 8–10): a pre-tokenizer regex
//! that backtracks past the engine's retry limit, a chat template of nested loops, and a
//! normalizer that multiplies its input are one-line errors, not a panic or a run that
//! grows until memory runs out; `--chat` without prompt text is a usage error.
mod common;

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

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
    let d = tempfile::tempdir()?;
    for e in std::fs::read_dir(common::fixture("llama_gqa"))? {
        let e = e?;
        std::fs::copy(e.path(), d.path().join(e.file_name()))?;
    }
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
    let mut child = std::process::Command::new(common::example_bin("llama"))
        .arg("--model-dir")
        .arg(dir)
        .args(["--max-new-tokens", "2"])
        .args(extra)
        .env("HF_HUB_OFFLINE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let start = Instant::now();
    while child.try_wait()?.is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            child.kill()?;
            anyhow::bail!("{extra:?} still running after two minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child.wait_with_output()?)
}

fn one_line_error(o: &Output, needles: &[&str]) -> Result<()> {
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(
        o.status.code() == Some(1),
        "exit {:?}: {err}",
        o.status.code()
    );
    for n in needles {
        ensure!(err.contains(n), "stderr lacks {n:?}: {err}");
    }
    ensure!(!err.contains("panicked"), "{err}");
    ensure!(err.lines().count() == 1, "not one line: {err}");
    Ok(())
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
    one_line_error(&o, &["encoding the text failed"])
}

#[test]
fn an_expanding_normalizer_is_refused_before_it_runs() -> Result<()> {
    let step = json!({"type": "Replace", "pattern": {"String": "a"}, "content": "a".repeat(1000)});
    let normalizer = json!({"type": "Sequence", "normalizers": [step, step, step, step]});
    let d = model_dir(&tokenizer(normalizer, json!({"type": "Whitespace"})), None)?;
    let o = run(d.path(), &["--prompt", "a a a a"])?;
    one_line_error(&o, &["normalizer", "`Replace`", "1000×"])
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
    one_line_error(&o, &["chat template failed", "fuel"])
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
