//! Input files a careless user gives (issue "Hardening II", items 4, 5 and 10): user files
//! are read only when regular and only up to a cap that names itself — `/dev/zero` as a
//! prompts file or tokenizer, a FIFO as a weight file or tokenizer, a directory named
//! `model.safetensors` — each a one-line error before any work; the environment's empty
//! `KVPOLICY_CACHE` is named; a budget error for a one-head group advises no smaller group.
mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{ensure, Result};

/// Runs the llama example with `args`, killed if it takes a minute (a FIFO that blocks).
fn llama(args: &[&str], env: &[(&str, &str)]) -> Result<Output> {
    let mut cmd = Command::new(common::example_bin("llama"));
    cmd.args(args).env("HF_HUB_OFFLINE", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    common::cli::output_within(&mut cmd, Duration::from_secs(60))
}

fn mkfifo(p: &Path) -> Result<()> {
    ensure!(
        Command::new("mkfifo").arg(p).status()?.success(),
        "mkfifo failed"
    );
    Ok(())
}

/// The fixture directory copied into `dir` without its weights.
fn fixture_without_weights(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(common::fixture("llama_gqa"))? {
        let e = e?;
        if e.path().extension().is_none_or(|x| x != "safetensors") && e.file_type()?.is_file() {
            std::fs::copy(e.path(), dir.join(e.file_name()))?;
        }
    }
    Ok(())
}

#[test]
fn devices_and_fifos_are_refused_as_prompts_files_and_tokenizers() -> Result<()> {
    let fixture = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let d = tempfile::tempdir()?;
    let fifo = d.path().join("fifo");
    mkfifo(&fifo)?;
    let fifo = fifo.to_string_lossy().into_owned();
    for file in ["/dev/zero", fifo.as_str()] {
        let o = llama(&["--model-dir", &fixture, "--prompts-file", file], &[])?;
        common::cli::one_line_error(&o, true, &["--prompts-file", file, "not a regular file"])?;
        let o = llama(&["--model-dir", &fixture, "--prompt-file", file], &[])?;
        common::cli::one_line_error(&o, true, &["--prompt-file", file, "not a regular file"])?;
        let o = llama(
            &[
                "--model-dir",
                &fixture,
                "--tokenizer",
                file,
                "--prompt",
                "hi",
            ],
            &[],
        )?;
        common::cli::one_line_error(&o, true, &["tokenizer", file, "not a regular file"])?;
    }
    Ok(())
}

#[test]
fn a_prompts_file_over_its_cap_is_refused_naming_the_cap() -> Result<()> {
    let fixture = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let d = tempfile::tempdir()?;
    let big = d.path().join("big.txt");
    // Sparse: 257 MiB of zero bytes that take no disk.
    std::fs::File::create(&big)?.set_len(257 << 20)?;
    let o = llama(
        &[
            "--model-dir",
            &fixture,
            "--prompts-file",
            &big.to_string_lossy(),
        ],
        &[],
    )?;
    common::cli::one_line_error(&o, true, &["--prompts-file", "larger than 256 MiB"])
}

#[test]
fn a_fifo_or_a_directory_as_the_weight_file_is_refused() -> Result<()> {
    let d = tempfile::tempdir()?;
    fixture_without_weights(d.path())?;
    let weights = d.path().join("model.safetensors");
    mkfifo(&weights)?;
    let dir = d.path().to_string_lossy().into_owned();
    let o = llama(&["--model-dir", &dir, "--prompt-ids", "1,2"], &[])?;
    common::cli::one_line_error(&o, true, &["model.safetensors", "not a regular file"])?;
    std::fs::remove_file(&weights)?;
    std::fs::create_dir(&weights)?;
    let o = llama(&["--model-dir", &dir, "--prompt-ids", "1,2"], &[])?;
    common::cli::one_line_error(&o, true, &["model.safetensors", "is a directory"])?;
    // A FIFO as config.json, too.
    std::fs::remove_dir(&weights)?;
    std::fs::copy(
        common::fixture("llama_gqa").join("model.safetensors"),
        &weights,
    )?;
    std::fs::remove_file(d.path().join("config.json"))?;
    mkfifo(&d.path().join("config.json"))?;
    let o = llama(&["--model-dir", &dir, "--prompt-ids", "1,2"], &[])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(
        o.status.code() == Some(1) && err.contains("config.json"),
        "{err}"
    );
    Ok(())
}

#[test]
fn an_empty_kvpolicy_cache_is_named() -> Result<()> {
    let d = tempfile::tempdir()?;
    let o = Command::new(common::example_bin("llama"))
        .args(["--prompt-ids", "1,2", "--max-new-tokens", "1"])
        .env("KVPOLICY_CACHE", "")
        .env("HF_HUB_OFFLINE", "1")
        .current_dir(d.path())
        .output()?;
    common::cli::one_line_error(&o, true, &["KVPOLICY_CACHE is set but empty"])?;
    ensure!(
        std::fs::read_dir(d.path())?.count() == 0,
        "files made in the current directory"
    );
    Ok(())
}

#[test]
fn the_default_models_fetch_error_is_one_line() -> Result<()> {
    // An empty cache, offline: every source fails.
    let cache = tempfile::tempdir()?;
    let hub = tempfile::tempdir()?;
    let o = llama(
        &["--prompt-ids", "1,2", "--max-new-tokens", "1"],
        &[
            ("KVPOLICY_CACHE", &cache.path().to_string_lossy()),
            ("HF_HOME", &hub.path().to_string_lossy()),
        ],
    )?;
    common::cli::one_line_error(
        &o,
        true,
        &["could not obtain the model", "--gguf/--model-dir"],
    )
}

#[test]
fn a_budget_too_small_for_one_head_does_not_advise_a_smaller_group() -> Result<()> {
    // The group is already one head: only the budget (or the chunk) can change.
    let fixture = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let o = llama(
        &[
            "--model-dir",
            &fixture,
            "--prompt-ids",
            "1,2,3",
            "--policy",
            "headwise",
            "--head-group",
            "1",
            "--device-kv-budget",
            "1KiB",
        ],
        &[],
    )?;
    common::cli::one_line_error(&o, false, &["--device-kv-budget"])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(!err.contains("smaller head group"), "{err}");
    Ok(())
}

#[test]
fn a_prompt_file_is_the_prompt_newlines_included() -> Result<()> {
    let fixture = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let gguf = common::default_gguf()?.to_string_lossy().into_owned();
    let d = tempfile::tempdir()?;
    let text = "one two\nthree four five\n";
    let file = d.path().join("prompt.txt");
    std::fs::write(&file, text)?;
    let ids = |args: &[&str], out: &str| -> Result<serde_json::Value> {
        let path = d.path().join(out);
        let p = path.to_string_lossy().into_owned();
        let mut all = vec!["--gguf", &gguf, "--max-new-tokens", "2", "--ids-out", &p];
        all.extend(args);
        let o = llama(&all, &[])?;
        ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        Ok(serde_json::from_str(&std::fs::read_to_string(&path)?)?)
    };
    let from_file = ids(&["--prompt-file", &file.to_string_lossy()], "a.json")?;
    let from_flag = ids(&["--prompt", text], "b.json")?;
    ensure!(from_file == from_flag, "{from_file} vs {from_flag}");
    let missing = d.path().join("missing.txt");
    let o = llama(
        &[
            "--model-dir",
            &fixture,
            "--prompt-file",
            &missing.to_string_lossy(),
        ],
        &[],
    )?;
    common::cli::one_line_error(&o, true, &["--prompt-file"])?;
    Ok(())
}
